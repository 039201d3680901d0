"""The shapes a plan was made for (its *shape envelope*), and the shape buckets a replan
caches by.

NOTE [ Shape envelope ]
    A plan's peak is measured at one batch's shapes; a batch with a longer sequence or
    more samples holds more activations, and the plan's budget says nothing about it. So
    a plan records the shapes it was made and proven for. An *input* is a path into the
    model's call: a keyword argument's name (``input_ids``), a positional argument's
    parameter name, and for nested batches the keys and indices below it
    (``inputs.mask``, ``pair.0``). Per proven batch, the envelope keeps each tensor
    input's shape; a batch is *inside* when, for one proven batch, every tensor input of
    the batch is an input of that batch with as many dimensions and none larger. So the
    envelope is a union of boxes (one per proven batch; a box inside another is
    dropped): a plan proven at ``(8, 512)`` and at ``(16, 256)`` admits neither
    ``(16, 512)`` nor anything it was not shown to fit. A shape inside a box but not
    itself proven is admitted because a step holds no more when a dimension shrinks.

    What is not part of it: inputs that are not tensors (flags, caches, ``None``), and
    0-dimensional tensors (a trainer's ``num_items_in_batch``), since they hold no
    activations. Values are not part of it either: a packed batch (position ids
    restarting inside a row) or a padded one (an attention mask with zeros) of the
    proven shapes is inside. An input no proven batch has is outside: an attention mask
    the plan never saw changes which attention kernel runs and what it keeps.

NOTE [ Shape buckets ]
    A replan (``on_new_shape="replan"``) plans for a shape *bucket*, not the exact shape,
    so a loader whose lengths vary replans a few times, not every step: each dimension
    larger than the plan's is rounded up to the next power of two, or to the next
    multiple of 64 when that is smaller (a length of 300 plans for 320, a batch of 12 for
    16); dimensions within the plan's stay as they are (an image's 3 channels never grow).
    The replan caches its plan under the bucket, and every later batch in it reuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.errors import message

#: One batch's inputs: ``(path, shape)`` pairs, sorted by path.
InputShapes = tuple[tuple[str, tuple[int, ...]], ...]
#: What a batch's shapes are given as: a mapping path -> shape, or ``(path, shape)`` pairs.
ShapesLike = Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]]
#: Rounding step of a large dimension's bucket (NOTE [ Shape buckets ]).
BUCKET_MULTIPLE = 64
#: What an applied plan does with a batch outside its envelope (``on_new_shape=``):
#: raise, warn and run, plan for the batch's shape bucket, or check nothing.
ON_NEW_SHAPE: tuple[str, ...] = ("error", "warn", "replan", "off")


def check_on_new_shape(value: Any, *, api: str) -> str:
    """``value`` if it is one of :data:`ON_NEW_SHAPE`.

    Raises:
        ValueError: anything else; the message lists the valid values.
    """
    if value not in ON_NEW_SHAPE:
        raise ValueError(message(api, f"unknown on_new_shape {value!r}",
                                 {"valid": ", ".join(ON_NEW_SHAPE)},
                                 fix='pass "error" (the default), "warn", "replan" or "off"'))
    return str(value)


def input_shapes(shapes: ShapesLike, *, owner: str = "ShapeEnvelope") -> InputShapes:
    """``shapes`` as sorted ``(path, shape)`` pairs of ints >= 0.

    Raises:
        ValueError: a path is not a non-empty string, or a dimension not an int >= 0.
    """
    pairs = shapes.items() if isinstance(shapes, Mapping) else shapes
    out: dict[str, tuple[int, ...]] = {}
    for path, shape in pairs:
        dims = tuple(shape)
        if not isinstance(path, str) or not path or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
            raise ValueError(message(owner, "an input needs a name and a shape of ints >= 0",
                                     {"found": f"{path!r}: {dims!r}"},
                                     fix="pass {'input_ids': (8, 512), ...}"))
        out[path] = dims
    return tuple(sorted(out.items()))


def _inside(shapes: Mapping[str, tuple[int, ...]], box: Mapping[str, tuple[int, ...]]) -> bool:
    for path, shape in shapes.items():
        bound = box.get(path)
        if bound is None or len(bound) != len(shape):
            return False
        for size, limit in zip(shape, bound, strict=True):
            if size > limit:
                return False
    return True


def format_shape(shape: Sequence[int]) -> str:
    """``(8, 512)``; ``(8,)`` for one dimension."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def shapes_label(shapes: ShapesLike) -> str:
    """``input_ids (8, 512), labels (8, 512)``."""
    return ", ".join(f"{path} {format_shape(shape)}" for path, shape in input_shapes(shapes))


@dataclass(frozen=True)
class ShapeEnvelope:
    """The batch shapes a plan was made and proven for (NOTE [ Shape envelope ]).

    A union of boxes, one per proven batch: each box is that batch's tensor inputs and
    their shapes, by path into the model's call (``input_ids``, ``inputs.mask``). A batch
    is inside when every tensor input it has fits one box, dimension by dimension.
    ``remat.plan`` records it in ``Plan.envelope``; ``remat.apply`` checks each batch
    against it before the forward (NOTE [ Shape guard ] in strategies/guard.py).

    Args:
        shapes: one entry per proven batch: ``{path: shape}`` or ``(path, shape)`` pairs.
            Boxes inside another are dropped; the rest are kept sorted.

    Example:
        >>> env = ShapeEnvelope.of({"input_ids": (8, 512), "labels": (8, 512)})
        >>> env.covers({"input_ids": (8, 300), "labels": (8, 300)})
        True
        >>> env.covers({"input_ids": (8, 1024), "labels": (8, 1024)})
        False
    """

    shapes: tuple[InputShapes, ...]

    def __post_init__(self) -> None:
        boxes = list(dict.fromkeys(input_shapes(s) for s in self.shapes))
        if not boxes:
            raise ValueError(message("ShapeEnvelope", "needs at least one batch's shapes",
                                     fix="pass ShapeEnvelope.of({'input_ids': (8, 512)})"))
        kept = [b for i, b in enumerate(boxes)
                if not any(j != i and _inside(dict(b), dict(other))
                           for j, other in enumerate(boxes))]
        object.__setattr__(self, "shapes", tuple(sorted(kept)))
        # Boxes as dicts, for the guard's per-step check (not a field: derived).
        object.__setattr__(self, "_boxes", tuple(dict(b) for b in self.shapes))

    @classmethod
    def of(cls, *shapes: ShapesLike) -> ShapeEnvelope:
        """The envelope of one or more batches' shapes (each ``{path: shape}``)."""
        return cls(tuple(input_shapes(s) for s in shapes))

    def covers(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """Whether a batch with these tensor inputs (path -> shape) is inside: one box holds
        every input, none larger in any dimension. Cheap: no allocation beyond the loop."""
        boxes: tuple[dict[str, tuple[int, ...]], ...] = self.__dict__["_boxes"]
        return any(_inside(shapes, box) for box in boxes)

    def union(self, other: ShapeEnvelope) -> ShapeEnvelope:
        """The envelope of both (a box inside another dropped)."""
        return ShapeEnvelope(self.shapes + other.shapes)

    def outside(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        """Why a batch is outside, against its nearest box, one reason per input (``[]``
        when it is inside): ``"input_ids (8, 1024) > (8, 512)"``, ``"attention_mask
        (8, 512): not an input of the plan's batch"``."""
        best: list[str] | None = None
        for box in self.__dict__["_boxes"]:
            reasons = []
            for path, shape in sorted(shapes.items()):
                bound = box.get(path)
                if bound is None:
                    reasons.append(f"{path} {format_shape(shape)}: not an input of the "
                                   "plan's batch")
                elif len(bound) != len(shape):
                    reasons.append(f"{path} {format_shape(shape)}: {len(shape)} dimensions, "
                                   f"the plan's has {len(bound)} {format_shape(bound)}")
                elif any(s > b for s, b in zip(shape, bound, strict=True)):
                    reasons.append(f"{path} {format_shape(shape)} > {format_shape(bound)}")
            if not reasons:
                return []
            if best is None or len(reasons) < len(best):
                best = reasons
        return best or []

    def bucket(self, shapes: Mapping[str, tuple[int, ...]]) -> InputShapes:
        """The bucket a replan for ``shapes`` plans for (NOTE [ Shape buckets ]): each
        dimension larger than the envelope's largest for that input and dimension rounded
        up by :func:`bucket_size`, the others kept.

        Example:
            >>> ShapeEnvelope.of({"input_ids": (8, 256)}).bucket({"input_ids": (8, 300)})
            (('input_ids', (8, 320)),)
        """
        out: dict[str, tuple[int, ...]] = {}
        for path, shape in shapes.items():
            limits = [box[path] for box in self.__dict__["_boxes"]
                      if len(box.get(path, ())) == len(shape)]
            largest = tuple(max(dims) for dims in zip(*limits, strict=True)) if limits \
                else (0,) * len(shape)
            out[path] = tuple(bucket_size(s) if s > lim else s
                              for s, lim in zip(shape, largest, strict=True))
        return input_shapes(out)

    def label(self) -> str:
        """``input_ids (8, 512), labels (8, 512)``; several boxes joined by ``" or "``."""
        return " or ".join(shapes_label(box) for box in self.shapes)

    def to_dict(self) -> dict[str, Any]:
        """``{"shapes": [{"input_ids": [8, 512], ...}, ...]}`` (the plan file's ``envelope``)."""
        return {"shapes": [{path: list(shape) for path, shape in box} for box in self.shapes]}

    @classmethod
    def from_dict(cls, data: Any) -> ShapeEnvelope:
        """Read what :meth:`to_dict` wrote.

        Raises:
            ValueError: not ``{"shapes": [{path: [dims]}, ...]}``.
        """
        boxes = data.get("shapes") if isinstance(data, Mapping) else None
        if not isinstance(boxes, list) or not all(isinstance(b, Mapping) for b in boxes):
            raise ValueError(message("ShapeEnvelope.from_dict", "malformed envelope",
                                     {"found": repr(data)[:120]},
                                     fix='write {"shapes": [{"input_ids": [8, 512]}]}'))
        return cls(tuple(input_shapes({str(k): tuple(v) for k, v in b.items()},
                                      owner="ShapeEnvelope.from_dict") for b in boxes))


def bucket_size(size: int) -> int:
    """``size`` rounded up to the next power of two, or to the next multiple of
    :data:`BUCKET_MULTIPLE` when that is smaller (NOTE [ Shape buckets ]).

    Example:
        >>> [bucket_size(n) for n in (3, 12, 64, 65, 300, 1000)]
        [4, 16, 64, 128, 320, 1024]
    """
    if size <= 1:
        return max(size, 0)
    power = 1 << (size - 1).bit_length()
    multiple = -(-size // BUCKET_MULTIPLE) * BUCKET_MULTIPLE
    return min(power, multiple)
