"""`dspark` command line: `dspark stack up|down|status`, `dspark target prepare NAME`,
`dspark export --format speculators|vllm|sglang REF OUT`,
`dspark runtime-env` (a Ray runtime env that records the submitting commit),
`dspark plan` (rollout tokens and device-hours for a target τ, from the measured learning curve),
`dspark memory TARGET --shards 1 2 4` (the frozen target's bytes per training worker, whole or sharded).

Each command group is a subparser whose handler returns an exit code; errors the user can fix
are printed as one line (`error: cause; fix`) instead of a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys


def _stack_up(args) -> int:
    from dspark.devstack import stack

    stack.up(stack.StackConfig.from_env(args.state_dir))
    return 0


def _stack_down(args) -> int:
    from dspark.devstack import stack

    stack.down(stack.StackConfig.from_env(args.state_dir))
    return 0


def _stack_status(args) -> int:
    from dspark.devstack import stack

    report = stack.status(stack.StackConfig.from_env(args.state_dir))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for service, info in report.items():
            state = "healthy" if info["healthy"] else ("running, unhealthy" if info["running"] else "stopped")
            note = "  (stale pid file)" if info["stale_pid_file"] else ""
            print(f"{service:7s} {state:19s} pid={info['pid'] or '-':<8} {info['url']}{note}")
    return 0 if all(info["healthy"] for info in report.values()) else 1


def _target_prepare(args) -> int:
    from dspark.io import storage
    from dspark.models.target import load_target

    target = load_target(args.name, local_copy=storage.local_copy)
    path = getattr(target.model, "name_or_path", "") or getattr(target.model.config, "_name_or_path", "")
    print(path)
    return 0


def _export(args) -> int:
    from dspark.export import export_ref

    print(export_ref(args.ref, args.out, args.format, target=args.target, verifier=args.verifier, dtype=args.dtype,
                     portable=args.portable))
    return 0


def _runtime_env(args) -> int:
    from dspark.io.tracking.lineage import write_runtime_env

    print(write_runtime_env(args.base, args.out))
    return 0


def _plan(args) -> int:
    from dspark.eval import planner

    curve, report = planner.curve_from_report(args.curve, args.form)
    rollout = dict(planner.rollout_tok_s_of(p) for p in args.rollout_bench)
    train = dict(planner.train_tok_s_of(p) for p in args.train_bench)
    kinds = [planner.DeviceThroughput(d, rollout[d], train[d]) for d in rollout if d in train]
    if not kinds:
        raise ValueError(f"no device kind has both a rollout ({sorted(rollout)}) and a training ({sorted(train)}) "
                         f"throughput; pass matching --rollout-bench / --train-bench files")
    measured_ratio, measured_per_prompt = planner.rollout_shape(report)
    ratio = args.prompt_per_generated if args.prompt_per_generated is not None else measured_ratio
    per_prompt = args.tokens_per_prompt if args.tokens_per_prompt is not None else measured_per_prompt
    rows_out = planner.make_plan(curve, kinds, args.tau, args.workers, args.epochs, ratio, per_prompt)
    if args.json:
        print(json.dumps({"curve": vars(curve), "prompt_per_generated": ratio, "tokens_per_prompt": per_prompt,
                          "rows": planner.rows_as_dicts(rows_out)}, indent=1))
    else:
        print(f"curve ({curve.form}): a={curve.a:.4g} b={curve.b:.4g} c={curve.c:.4g}, measured "
              f"{curve.t_min:.3g}..{curve.t_max:.3g} rollout tokens; prompt/generated tokens {ratio:.2f}, "
              f"{per_prompt:.0f} generated tokens per prompt; {args.workers} workers scale ideally (upper bound)")
        print(planner.format_table(rows_out))
    return 0


def _memory(args) -> int:
    from transformers import AutoConfig

    from dspark.io import storage
    from dspark.models.sharded_target import target_memory_plan
    from dspark.models.target import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(args.target, storage.local_copy))
    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    rows = [target_memory_plan(config, dtype_bytes, shards) for shards in args.shards]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    gib = 2**30
    print(f"{args.target}: {rows[0]['params'] / 1e9:.3g} B parameters ({args.dtype}), "
          f"{rows[0]['decoder_layer_params'] / rows[0]['params']:.0%} of them in decoder layers")
    if moe := rows[0]["moe"]:
        print(f"  MoE: {moe['blocks']} blocks of {moe['experts']} experts, top {moe['top_k']}: "
              f"{moe['active_params'] / 1e9:.3g} B parameters per token; routers {moe['router_params'] / 1e6:.3g} M "
              f"({moe['router_share']:.2%} of a token's FLOPs); every expert is held in memory")
    for row in rows:
        fits = "" if args.device_gib is None else (
            "  fits" if row["bytes_per_worker"] <= args.device_gib * gib else "  does not fit")
        print(f"  target_shards={row['shards']:<3d} {row['bytes_per_worker'] / gib:8.2f} GiB per worker "
              f"({row['ratio']:.2f} of a whole copy){fits}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative-decoding toolkit")
    groups = parser.add_subparsers(dest="group", required=True)

    stack_parser = groups.add_parser("stack", help="local S3 + MLflow + Ray stack on 127.0.0.1")
    stack_parser.add_argument("--state-dir", default=None,
                              help="state directory (default: $DSPARK_STATE_DIR or <repo>/.dspark)")
    stack_cmds = stack_parser.add_subparsers(dest="command", required=True)
    stack_cmds.add_parser("up", help="start (or reuse) the services and write env.sh").set_defaults(func=_stack_up)
    stack_cmds.add_parser("down", help="stop the services this state dir started").set_defaults(func=_stack_down)
    status_parser = stack_cmds.add_parser("status", help="report each service (exit 1 unless all healthy)")
    status_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    status_parser.set_defaults(func=_stack_status)

    target_parser = groups.add_parser("target", help="target models")
    target_cmds = target_parser.add_subparsers(dest="command", required=True)
    prepare = target_cmds.add_parser("prepare", help="build/download a target into the cache and print its path")
    prepare.add_argument("name", help='"tiny", "smollm2-135m", a local dir, an s3:// dir or a hub name')
    prepare.set_defaults(func=_target_prepare)

    export = groups.add_parser("export", help="write a drafter in a serving engine's checkpoint layout")
    export.add_argument("--format", required=True, choices=("speculators", "vllm", "sglang"),
                        help="vllm: vLLM's speculators loaders; speculators: the speculators library; "
                             "sglang: SGLang's Eagle3/DFlash/DSpark loaders")
    export.add_argument("--target", default=None, help="target spec to load (default: the one the checkpoint names)")
    export.add_argument("--verifier", default=None,
                        help="verifier name_or_path written into the config (default: the target's hub id or dir; "
                             "a local dir is warned about: another machine cannot open it)")
    export.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="weight dtype of the export (recorded as torch_dtype in config.json)")
    export.add_argument("--portable", action="store_true",
                        help="refuse to write an export that names its verifier by a path on this machine "
                             "(requires --verifier with a hub id)")
    export.add_argument("ref", help="drafter: a local dir, s3://..., runs:/<run>/<path> or "
                                    "models:/<name>/<version|@alias>")
    export.add_argument("out", help="output directory (local or s3://)")
    export.set_defaults(func=_export)

    env_parser = groups.add_parser(
        "runtime-env", help="write a Ray runtime env with DSPARK_GIT_COMMIT set to this checkout's commit",
        description="Jobs record the commit in MLflow; a submitted working_dir has no .git, so submit with "
                    "`ray job submit --runtime-env $(dspark runtime-env) --working-dir . -- python -m jobs.<stage> ...`")
    env_parser.add_argument("--base", default="infra/runtime_env.yaml", help="runtime env YAML to extend")
    env_parser.add_argument("--out", default=".dspark/runtime_env.yaml", help="where to write it (printed)")
    env_parser.set_defaults(func=_runtime_env)

    plan = groups.add_parser("plan", help="rollout tokens and device-hours for a target tau (from measurements)",
                             description="Fits tau(rollout tokens) to a learning-curve JSON and combines it with "
                                         "measured rollout/training throughputs per device kind (dspark/eval/planner.py)")
    plan.add_argument("--curve", required=True, help="learning-curve JSON (recipes.learning_curve's; the committed "
                                                    "CPU one is under the repo's learning_curve results)")
    plan.add_argument("--form", choices=("loglinear", "power"), default="loglinear", help="curve form to fit")
    plan.add_argument("--rollout-bench", nargs="+", required=True, help="rollout throughput JSON(s), one per device")
    plan.add_argument("--train-bench", nargs="+", required=True, help="training throughput JSON(s), one per device")
    plan.add_argument("--tau", type=float, nargs="+", default=[2.0, 3.0], help="target tau value(s)")
    plan.add_argument("--workers", type=int, default=1, help="N workers (devices) of each kind")
    plan.add_argument("--epochs", type=float, default=2.0, help="training passes over the rollouts")
    plan.add_argument("--prompt-per-generated", type=float, default=None,
                      help="prompt tokens per generated token (default: from the curve's rollouts)")
    plan.add_argument("--tokens-per-prompt", type=float, default=None,
                      help="generated tokens per prompt for the paper row (default: from the curve's rollouts)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=_plan)

    memory = groups.add_parser("memory", help="the frozen target's memory per training worker, whole or sharded",
                               description="From the target's config alone (nothing is loaded): bytes per worker "
                                           "for scaling.target_shards = each --shards value (decoder layers / N + "
                                           "the embedding, norm and LM head every worker keeps + one gathered "
                                           "layer; dspark/models/sharded_target.py)")
    memory.add_argument("target", help='"tiny", "smollm2-135m", a local model dir or an s3:// dir')
    memory.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8], help="target_shards value(s)")
    memory.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="the target's dtype")
    memory.add_argument("--device-gib", type=float, default=None, help="say whether each fits a device of this size")
    memory.add_argument("--json", action="store_true", help="print JSON instead of a table")
    memory.set_defaults(func=_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark.devstack.stack import StackError

    expected = (StackError, ValueError, FileNotFoundError, PermissionError)  # ConfigError is a ValueError
    try:
        return args.func(args)
    except expected as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
