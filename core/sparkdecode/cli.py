"""``sparkdecode demo|providers|check|bench``: what runs where, how fast, and why."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import torch

from .arguments import UsageError, at_least, device_of, parse_pins
from .bench import add_parser as add_bench_parser
from .deployment import DeploymentError, detect, requirements
from .executor import DecodeConfig, SpecializedDecode
from .harness import DecodeHarness
from .layout import LayoutError, resolve, unsupported_reason
from .plugins import discover
from .reference.model import ReferenceModel
from .spec import ModelSpec, SpecError
from .weights import EXPERT_FORMATS, random_weights

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_DEMO_LAYERS = 62


def _spec(args: argparse.Namespace) -> ModelSpec:
    if getattr(args, "config", None):
        spec = ModelSpec.from_config(args.config)
        return spec if args.layers is None else spec.with_layers(args.layers)
    return ModelSpec.preset(args.preset, args.layers)


def demo(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    pins = parse_pins(args.pin)
    spec = ModelSpec.preset("tiny", args.layers)
    needed = args.prompt + 8 * args.steps
    if needed > args.max_context:
        raise UsageError(
            f"--prompt {args.prompt} and --steps {args.steps} of 8 tokens need a context of {needed}, "
            f"above --max-context {args.max_context}"
        )
    if args.max_context > spec.max_position_embeddings:
        raise UsageError(
            f"--max-context {args.max_context} is above the tiny model's {spec.max_position_embeddings} positions"
        )
    print(
        f"sparkdecode demo: tiny Muse Spark (H {spec.H}, {spec.num_layers} layers, E {spec.E} top-{spec.top_k}, "
        f"window {spec.sliding_window}), random weights (seed {args.seed}), on {device}"
    )
    weights = random_weights(spec, seed=args.seed, device=device)
    config = DecodeConfig(
        q=8,
        max_rows=8,
        max_context=args.max_context,
        aux_layers=(0, spec.num_layers // 2, spec.num_layers),
        pins=pins,
    )
    executor = SpecializedDecode(weights, config)
    print(executor.layout.table())
    model = ReferenceModel(weights, args.max_context)
    harness = DecodeHarness(model, executor, max_prompt=args.prompt, seed=args.seed)
    prompt = torch.randint(0, spec.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(args.seed))
    harness.prefill(prompt.to(device))
    print(f"prefilled {args.prompt} tokens; {args.steps} verify steps of {config.q} tokens")
    results = [harness.verify() for _ in range(args.steps)]
    for i, r in enumerate(results):
        if args.verbose:
            print(
                f"  step {i:3d} at {r.first_position:5d}: hidden diff {r.hidden_diff:.3g}, "
                f"logits diff {r.logits_diff:.3g}, greedy {'agree' if r.greedy_agree else 'DIFFER'}, "
                f"accepted {r.accepted}"
            )
    agree = sum(r.greedy_agree for r in results)
    aux_diff = max(
        ((a.float() - b.float()).abs().max().item() for r in results for a, b in zip(r.stock_aux, r.executor_aux)),
        default=0.0,
    )
    print(f"context after the steps: {harness.position} tokens")
    print(f"largest |hidden stock - executor|: {max(r.hidden_diff for r in results):.3g}")
    print(f"largest |logits stock - executor|: {max(r.logits_diff for r in results):.3g}")
    print(f"largest |aux stock - executor|: {aux_diff:.3g}")
    print(f"greedy tokens agree: {agree}/{len(results)} steps")
    stock_ms = statistics.median(r.stock_seconds for r in results) * 1e3
    exec_ms = statistics.median(r.executor_seconds for r in results) * 1e3
    print(f"step time (median, eager, not a benchmark): stock {stock_ms:.2f} ms, executor {exec_ms:.2f} ms")
    return 0 if agree == len(results) else 1


def providers(args: argparse.Namespace) -> int:
    spec = _spec(args)
    deployment = detect(spec, args.tp, max_context=args.max_context, expert_format=args.expert_format)
    registry = discover()
    where = deployment.gpu_name or deployment.device
    print(
        f"providers for {where}, TP {args.tp}, {spec.num_layers} layers, max context {args.max_context}, "
        f"{args.expert_format} experts"
    )
    for reason in requirements(deployment):
        print(f"the executor does not take this deployment: {reason}")
    rows = sorted(registry.providers, key=lambda r: (r.block, r.name))
    kind_w = max((len(r.block) for r in rows), default=5) + 1
    name_w = max((len(r.name) for r in rows), default=8) + 1
    print(f"{'block':<{kind_w}} {'provider':<{name_w}} {'pack':<12} {'version':<10} here")
    for reg in rows:
        reason = unsupported_reason(reg, deployment)
        here = "supported" if reason is None else f"unsupported: {reason}"
        print(f"{reg.block:<{kind_w}} {reg.name:<{name_w}} {reg.pack:<12} {reg.version:<10} {here}")
    for pack, reason in registry.broken:
        print(f"broken pack {pack}: {reason}")
    return 0


def check(args: argparse.Namespace) -> int:
    pins = parse_pins(args.pin)
    spec = _spec(args)
    deployment = detect(spec, args.tp, max_context=args.max_context, expert_format=args.expert_format)
    reasons = requirements(deployment)
    if reasons:
        for reason in reasons:
            print(f"unsupported: {reason}")
        return 1
    registry = discover()
    for pack, reason in registry.broken:
        print(f"broken pack {pack}: {reason}")
    try:
        layout = resolve(registry, deployment, pins)
    except LayoutError as e:
        print(f"unsupported: {e}")
        return 1
    print("supported; the layout (by priority: measured at build on a GPU):")
    print(layout.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkdecode", description=__doc__)
    parser.add_argument(
        "--log",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="log level (INFO shows the executor's decisions)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="tiny random-weight model: stock forward vs the executor")
    p.add_argument(
        "--layers", type=at_least(1, MAX_DEMO_LAYERS), default=4, help=f"at most {MAX_DEMO_LAYERS} (Muse Spark's depth)"
    )
    p.add_argument("--prompt", type=at_least(1), default=100, help="prompt tokens to prefill")
    p.add_argument("--steps", type=at_least(1), default=16, help="verify steps of 8 tokens")
    p.add_argument("--max-context", type=at_least(1), default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--pin", action="append", default=[], metavar="BLOCK=PROVIDER")
    p.add_argument("--verbose", action="store_true", help="one line per step")
    p.set_defaults(run=demo)

    for name, fn, helptext in (
        ("providers", providers, "every discovered provider and whether it serves this deployment"),
        ("check", check, "whether a deployment is supported, and its layout"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--preset", default="muse-spark-open", help="tiny or muse-spark-open")
        p.add_argument("--config", default=None, help="a config.json or checkpoint directory instead of a preset")
        p.add_argument("--layers", type=at_least(1), default=None)
        p.add_argument("--tp", type=at_least(1), default=1)
        p.add_argument("--max-context", type=at_least(1), default=32768)
        p.add_argument("--expert-format", default="bf16", help=", ".join(EXPERT_FORMATS))
        if fn is check:
            p.add_argument("--pin", action="append", default=[], metavar="BLOCK=PROVIDER")
        p.set_defaults(run=fn)

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log, format="%(message)s")
    try:
        return args.run(args)
    except (SpecError, DeploymentError, LayoutError, UsageError) as e:
        print(f"sparkdecode: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
