"""The invariants of a run (DESIGN §7), folded batch by batch into an ``AuditState``: one module per
family of invariants, and the driver that calls each.

Strict invariants name every offender (step, sample, row, layer, both values); metrics are counts
and exact sums per step. The work per batch is vectorised over the batch's samples: the routes of a
whole row group are one array, validated and compared by ``harness.trace``'s and
``harness.audit.checks.kernels``' kernels in one call each; offenders are located only in a batch that
failed the fast check. Rows and layers in offenders: ``row`` is the index in the sample's trace
(position ``routes_start + row``), ``layer`` the decoder index of the MoE layer.

- ``invariants``: every invariant's name, in report order, and the columns each reads;
- ``fold``: ``AuditOptions`` and the driver, ``fold_batch`` and ``fold_shards``;
- ``context``: ``BatchContext``, what the families of one batch share, and ``Offenders``;
- ``coverage``: ``coverage``, ``splice_consistency`` and ``shard_union``;
- ``ids``: ``ids_valid``, ``moe_layer_nonzero`` and ``dense_empty``;
- ``repeats``: ``repeated_rows``; ``tokens``: ``tokens_match``;
- ``logprobs``: ``logprobs_valid`` and the ``logprob_gap`` metric;
- ``replay``: ``replay_fidelity`` and the ``agreement`` metric;
- ``load``: the ``fallback`` and ``expert_load`` metrics; ``prefix``: ``prefix_agreement``;
- ``state``: ``AuditState``, the mergeable accumulators every family folds into, and
  ``shard_cover``: which route rows of a sample the shard rows of a CP/SP run claimed;
- ``kernels``, ``repeat_kernels``, ``shared_kernels``: the compiled kernels.

The modules import the run layout's batch, this package's state and kernels,
``harness.trace`` and ``harness.metrics``; a family imports ``context`` and no other family (``fold``
imports them all). This package's ``__init__`` imports nothing.
"""
