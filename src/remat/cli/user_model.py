"""``--module FILE.py:FACTORY`` or ``--module package.module:FACTORY``: your own model.

Every ``remat`` command runs a model that a function of yours builds. The factory is
called with no arguments and returns one of:

(a) an ``nn.Module``. remat makes its batches as for Hugging Face models (random
    ``input_ids`` and ``labels`` below ``model.config.vocab_size``); a model without
    ``config.vocab_size`` must come with a batch, as (b) or (c).
(b) a tuple ``(model, batch)``: one fixed batch, a tensor (``model(batch)``), a tuple of
    arguments (``model(*batch)``) or a dict of keyword arguments (``model(**batch)``).
    ``--batch`` and ``--seq`` cannot resize it: ``profile``, ``compare`` and ``plan`` print
    a note and use the batch as it is; commands that try several batch sizes
    (``simulate --batch 1,2,4``, ``plan --maximize``, ``estimate``) exit with an error.
(c) an object (a ``SimpleNamespace``, a small class) with attribute ``model`` and
    optionally ``make_batch(batch_size, seq_len) -> batch`` (then ``--batch`` and ``--seq``
    apply), ``batch`` (one fixed batch, as in (b)) and ``loss_fn(output, batch) -> scalar``.

The loss is ``loss_fn(output, batch)`` when the factory gives one (the signature
``remat.profile``, ``remat.plan`` and ``remat.compare`` take), else remat's default:
``output.loss``, else the first element of a tuple output, else the mean of a tensor
output (:func:`remat.measure.step.default_loss`).

``profile``, ``compare`` and ``plan`` call the factory after ``torch.manual_seed(--seed)``
and move the model and batches to ``--device``; ``compare`` calls it once per strategy,
so it should build the same weights for the same seed. ``simulate`` and ``estimate``
call it under ``torch.device("meta")`` (parameters allocate nothing); a factory that
reads tensor values (loads weights, calls ``.item()``) cannot be simulated.
A file's directory is on ``sys.path`` while it is imported and its factory runs, as for
``python FILE.py``.

Example::

    # my_model.py
    def build():
        model = MyNet()
        return model, torch.randn(8, 3, 224, 224)

    $ remat plan --module my_model.py:build --budget 60%
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from rich.markup import escape

from remat.cli.common import fail
from remat.errors import message

#: How the option's value is spelled, for messages.
FORMS = "FILE.py:FACTORY or package.module:FACTORY"


@dataclass(frozen=True)
class UserModel:
    """What a ``--module`` factory returned, checked against the contract.

    Args:
        model: the model (an ``nn.Module``).
        batch: its one fixed batch, or ``None`` when batches are made.
        make_batch: ``make_batch(batch_size, seq_len) -> batch``, or ``None``.
        loss_fn: ``loss_fn(output, batch) -> scalar``, or ``None`` (remat's default loss).
    """

    model: Any
    batch: Any = None
    make_batch: Callable[[int, int], Any] | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None

    @property
    def vocab_size(self) -> int | None:
        """``model.config.vocab_size`` when it is an int (remat can make token batches)."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def raised(api: str, what: str, exc: BaseException, fix: str) -> NoReturn:
    """Exit 2 naming the user's exception and the line of their code that raised it (the
    deepest frame outside torch, remat and importlib)."""
    import torch

    import remat

    skip = (str(Path(torch.__file__).parent), str(Path(remat.__file__).parent), "<frozen")
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not f.filename.startswith(skip)] or frames
    facts = {"error": f"{type(exc).__name__}: {exc}"}
    if own:
        facts["at"] = f"{own[-1].filename}:{own[-1].lineno} in {own[-1].name}"
    fail(escape(message(api, what, facts, fix=fix)))  # the user's text is not rich markup


@contextlib.contextmanager
def _importable(folder: Path | None) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while the block runs (sibling imports work)."""
    if folder is None:
        yield
        return
    entry = str(folder.resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def _split(spec: str, api: str, option: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        fail(message(api, f"cannot read {option} {spec!r}", {"expected": FORMS},
                     fix=f"write e.g. {option} my_model.py:build or {option} "
                         "mypkg.models:build"))
    return target, name


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(path: Path, spec: str, api: str, option: str) -> ModuleType:
    if not path.is_file():
        fail(message(api, f"{option} {spec}: no file {str(path)!r}",
                     {"looked in": str(path.resolve().parent)},
                     fix="pass the path of a .py file (relative to the current directory), "
                         "or package.module:FACTORY for an importable module"))
    name = f"_remat_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    loaded = importlib.util.spec_from_file_location(name, path)
    if loaded is None or loaded.loader is None:
        fail(message(api, f"{option} {spec}: {str(path)!r} cannot be imported as Python",
                     fix="pass a .py file"))
    module = importlib.util.module_from_spec(loaded)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    try:
        with _importable(path.parent):
            loaded.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raised(api, f"{option} {spec}: importing {str(path)!r} raised an error", exc,
                fix=f"fix the error in {path.name} (run python {path} to see it in full)")
    return module


def _import_module(target: str, spec: str, api: str, option: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (target == exc.name or target.startswith(exc.name + ".")):
            fail(message(api, f"{option} {spec}: no module named {exc.name!r}",
                         {"sys.path": ", ".join(p or "." for p in sys.path[:4]) + ", ..."},
                         fix="install the package, put its folder on PYTHONPATH, or pass "
                             "the file's path (path/to/file.py:FACTORY)"))
        raised(api, f"{option} {spec}: importing {target!r} raised an error", exc,
                fix=f"fix the import in {target}")
    except Exception as exc:
        raised(api, f"{option} {spec}: importing {target!r} raised an error", exc,
                fix=f"fix the error in {target}")


def load_attribute(spec: str, api: str, *, option: str = "--module"
                   ) -> tuple[Any, ModuleType, Path | None]:
    """What ``FILE.py:NAME`` or ``package.module:NAME`` names (None where the module has no
    NAME), the module, and the folder to keep importable while it runs (None for a
    module). Exits 2, naming ``option``, when the spec is malformed or the file or module
    does not exist or fails to import."""
    target, name = _split(spec, api, option)
    if _is_file(target):
        path = Path(target)
        module, folder = _import_file(path, spec, api, option), path.parent
    else:
        module, folder = _import_module(target, spec, api, option), None
    return getattr(module, name, None), module, folder


def load_factory(spec: str, api: str) -> tuple[Callable[[], Any], Path | None]:
    """The factory ``spec`` names, and the folder to keep importable while it runs.

    Exits 2 (with the user's exception type and message, never a remat traceback) when
    the spec is malformed, the file or module does not exist or fails to import, or it
    has no callable of that name.
    """
    factory, module, folder = load_attribute(spec, api)
    target, name = spec.rpartition(":")[::2]
    if factory is None:
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        fail(message(api, f"--module {spec}: {target} has no {name!r}",
                     {"callables defined there": ", ".join(defined) or "none"},
                     fix=f"define def {name}(): ... returning the model, or name another "
                         "function after the colon"))
    if not callable(factory):
        fail(message(api, f"--module {spec}: {name!r} is a {type(factory).__name__}, not a "
                          "function", fix=f"make {name} a function of no arguments"))
    return factory, folder


_CONTRACT = "a model, (model, batch), or an object with .model"


def call_factory(factory: Callable[[], Any], folder: Path | None, spec: str, api: str, *,
                 meta: bool = False) -> UserModel:
    """Call ``factory()`` (under ``torch.device("meta")`` with ``meta``) and check its result.

    Exits 2 with what is missing when the result does not follow the contract in the
    module docstring, and with the user's exception when the call raises.
    """
    import torch

    try:
        with _importable(folder), (torch.device("meta") if meta else contextlib.nullcontext()):
            result = factory()
    except Exception as exc:
        if meta:
            raised(api, f"--module {spec}: the model cannot be simulated: calling the "
                        "factory on the meta device raised an error", exc,
                   fix="build the model without reading tensor values (no weight loading, "
                       "no .item()), or measure it for real with remat profile / remat plan")
        raised(api, f"--module {spec}: calling the factory raised an error", exc,
               fix="fix the factory (call it in Python to see the whole traceback)")
    return check_contract(result, spec, api)


def check_contract(result: Any, spec: str, api: str) -> UserModel:
    """``result`` as a :class:`UserModel`; exits 2 saying what breaks the contract."""
    from torch import nn

    where = f"--module {spec}"
    if isinstance(result, nn.Module):
        user = UserModel(result)
    elif isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[0], nn.Module):
            found = ", ".join(type(r).__name__ for r in result)
            fail(message(api, f"{where} returned a tuple of ({found})",
                         {"expected": "(model, batch) with model an nn.Module"},
                         fix="return (model, batch), the model alone, or an object with "
                             ".model and .make_batch(batch_size, seq_len)"))
        user = UserModel(result[0], batch=result[1])
    elif hasattr(result, "model"):
        user = _from_object(result, where, api)
    else:
        fail(message(api, f"{where} returned a {type(result).__name__}",
                     {"expected": _CONTRACT},
                     fix="return the nn.Module, (model, batch), or e.g. SimpleNamespace("
                         "model=model, make_batch=make_batch, loss_fn=loss_fn)"))
    if user.batch is None and user.make_batch is None and user.vocab_size is None:
        fail(message(api, f"{where} returned a model but no batch",
                     {"model": type(user.model).__name__,
                      "why": "remat makes token batches only for models with "
                             "config.vocab_size"},
                     fix="return (model, batch) or an object with "
                         "make_batch(batch_size, seq_len)"))
    return user


def _from_object(result: Any, where: str, api: str) -> UserModel:
    from torch import nn

    kind = type(result).__name__
    model = result.model
    if not isinstance(model, nn.Module):
        fail(message(api, f"{where} returned a {kind} whose .model is a "
                          f"{type(model).__name__}", {"expected": "an nn.Module"},
                     fix="set .model to the nn.Module to train"))
    parts: dict[str, Any] = {}
    for name in ("make_batch", "loss_fn"):
        value = getattr(result, name, None)
        if value is not None and not callable(value):
            fail(message(api, f"{where} returned a {kind} whose .{name} is a "
                              f"{type(value).__name__}, not a function",
                         fix=f"set .{name} to a function, or leave it out"))
        parts[name] = value
    return UserModel(model, batch=getattr(result, "batch", None), **parts)
