"""Parallel training, per rank: tensor / sequence parallelism, pipeline stages, FSDP / DDP.

Each module answers what one rank of a parallel run holds or runs, for the planner, the
simulator and the adapters in :mod:`remat.integrations` alike:

* tensor and sequence parallelism: :mod:`~remat.distributed.tp_fused` (fused projections
  split per rank), :mod:`~remat.distributed.tp_roles` (each linear's role),
  :mod:`~remat.distributed.tp_layout` (the DTensor layout ``apply_tp`` applies),
  :mod:`~remat.distributed.tp_step` (one rank's step on a fake process group),
  :mod:`~remat.distributed.tensor_parallel` (``tp_rank_bytes``);
* pipelines: :mod:`~remat.distributed.schedule` (each rank's actions),
  :mod:`~remat.distributed.pipeline_fsdp` (the FSDP replay of an action list),
  :mod:`~remat.distributed.pipeline_record` and :mod:`~remat.distributed.pipeline`
  (``pipeline_rank_bytes``), :mod:`~remat.distributed.stage_loss` (``StageLoss``),
  :mod:`~remat.distributed.stage` (``LlamaStage``, ``plan_stage``),
  :mod:`~remat.distributed.pipeline_rank` (``plan_rank``: a rank's chunks planned together);
* data parallelism: :mod:`~remat.distributed.sharding` (FSDP / DDP per-rank bytes),
  :mod:`~remat.distributed.sharded` (DTensor and FSDP tensors, measured per rank).

The package is a vertical slice (tests/test_layers.py ``SLICES``): each module sits in the
layer of what it builds on (``schedule``, ``pipeline_fsdp`` and ``sharding`` in core,
``sharded`` and ``stage_loss`` in measure, the simulated steps in simulate, ``stage`` and
``pipeline_rank`` in planning), and its modules import each other one way: schedule <-
pipeline_fsdp <- pipeline; tp_fused <- tp_roles <- tp_layout <- tp_step <- tensor_parallel,
pipeline; stage_loss <- stage <- pipeline_rank. Importing the package imports none of them.
"""
