"""Train–inference log-prob gap metrics (FACTS §5), with one sign convention.

Every metric here is a function of the per-token log-ratio on the *sampled* tokens::

    Δ = log π_train(y_t) − log π_infer(y_t)

restricted to the masked-in (response) tokens. ``train_logprobs`` are the trainer's recomputed
log-probs, ``infer_logprobs`` the inference engine's rollout log-probs. Positive Δ means the trainer
gives the sampled token more probability than the engine that sampled it.

Inputs may be numpy arrays, torch tensors (detached, moved to CPU) or array-likes of floats; all
arithmetic is float64 numpy and every result is a plain Python ``float`` (``int`` for counts).

Empty selection (the mask selects no token): ``n_tokens == 0`` and every mean, maximum and fraction
is ``nan``; no exception and no numpy warning. The Pearson correlation is ``nan`` whenever it is
undefined (fewer than two tokens, or either probability vector has zero variance).

Malformed input raises :class:`harness.errors.MetricError` naming the argument and the expected
value: shape mismatch, non-floating log-probs, a mask that is not bool or 0/1, NaN/inf in masked-in
entries, or masked-in log-probs above ``LOGPROB_TOLERANCE`` (not a log-probability). Masked-out
entries are never inspected, so padding may hold anything.

One concern per module; import each name from its module (this package exports nothing):

- ``inputs``: coercion and validation of the inputs, the masked-in tokens, the metrics' parameters
  (``LOGPROB_TOLERANCE``, ``DEFAULT_TAU``, the IcePop band);
- ``terms``: the per-token terms of every metric and their reductions, each formula written once;
- ``accumulator``: the mergeable, exact accumulator (``ExactSum``, ``GapTerms``, ``GapAccumulator``)
  and its result, ``LogprobGap``, of ``logprob_gap`` (every metric at once);
- ``batch``: each metric on its own, of one batch (``mean_abs_diff``, ``k3``, ``extreme_fraction``,
  ``gap_growth_bound``, …).

Core layer (DESIGN §4): these modules import numpy, numba, torch (only when the caller already has),
``harness.errors`` and each other; nothing above the core.
"""
