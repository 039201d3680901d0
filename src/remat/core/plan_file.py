"""The plan file's envelope, shared by PyTorch and JAX plans: format, framework, version.

NOTE [ Plan file envelope ]
    Every plan file is a JSON object ``{"format": "remat.plan", "version": N,
    "framework": "torch" | "jax", ...}``; what follows the envelope is the framework's
    own (``remat.planning.plans``, ``remat.jax.plans``). A reader checks the envelope
    first, in this order, so the error names the first thing that is wrong: not a
    remat plan; a plan for the other framework (the message names the loader to use:
    a file without ``framework`` was written for PyTorch); a version this remat does
    not read (the message lists the versions it reads). Each framework keeps its own
    version number and the versions it still reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from remat.errors import message

#: The ``format`` of every remat plan file.
FORMAT = "remat.plan"
#: Who reads a plan of each framework.
LOADERS: Mapping[str, str] = {"torch": "remat.Plan.from_json",
                              "jax": "remat.jax.Plan.from_json"}


def envelope(framework: str, version: int) -> dict[str, Any]:
    """The first keys of a plan file (NOTE [ Plan file envelope ])."""
    return {"format": FORMAT, "version": version, "framework": framework}


def load_json(text: str, *, api: str) -> Any:
    """``json.loads(text)``; a ``ValueError`` whose first line names ``api`` otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(message(api, "not valid JSON", {"error": exc},
                                 fix="pass the text plan.to_json() wrote")) from None


def read_envelope(data: Any, *, framework: str, versions: Sequence[int], api: str,
                  make: str) -> int:
    """Check a plan file's envelope and return its version (NOTE [ Plan file envelope ]).

    Args:
        data: the parsed file.
        framework: the framework the reader is for (``"torch"``, ``"jax"``).
        versions: the versions it reads.
        api: the reader's name, first on every error line (``"remat.Plan.from_json"``).
        make: how to make a plan of this framework, named by the version error
            (``"remat.plan(...)"``).

    Raises:
        ValueError: not a remat plan, another framework's plan, or an unread version.

    Example:
        >>> read_envelope(envelope("torch", 2), framework="torch", versions=(1, 2),
        ...               api="remat.Plan.from_json", make="remat.plan(...)")
        2
    """
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(message(api, "not a remat plan",
                                 {"format": repr(found), "expected": repr(FORMAT)},
                                 fix="write plans with plan.to_json()"))
    found_framework = data.get("framework", "torch")
    if found_framework != framework:
        loader = LOADERS.get(str(found_framework), "the loader of that framework")
        what = f"this is a {found_framework!r} plan, not a {framework!r} one"
        raise ValueError(message(api, what,
                                 {"framework": repr(data.get("framework"))},
                                 fix=f"load it with {loader}(...), or make a {framework} plan "
                                     f"with {make}"))
    version = data.get("version")
    if not isinstance(version, int) or version not in versions:
        raise ValueError(message(api, f"plan format version {version!r} is not supported",
                                 {"this remat reads versions": ", ".join(map(str, versions))},
                                 fix=f"re-create the plan with {make} using this remat version, "
                                     "or install the remat version that wrote it"))
    return version
