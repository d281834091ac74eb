"""``sparkdecode bench``: the benchmark every speed claim comes from.

One decode step (one request verifying 8 tokens) of a named config
(``configs.py``), at each context and routing: the torch baseline
(``baseline.py``) and the executor, each captured once in a CUDA graph and
replayed many times; each block alone in a graph (orientation only), and with
``--candidates KIND`` every provider that supports KIND (``attention``,
``attention_core``) per layer alone in a graph; the bytes
the step must read over the copy bandwidth measured in the same run (the floor,
``floor.py``); a table, a JSON record, and with ``--plot`` a PNG
(``report.py``). On the CPU it runs eagerly and says it is not a speed claim.
``--watch`` samples the GPU's SM clock, power and clock-event reasons through the
executor's timed replays (``clockwatch.py``): whether the step ran at the power cap.

A config of every rank (``tp{2,4,8}-L<N>-bf16``, ``-nvfp4``, ``-nvfp4-marlin``,
``tiny-tp{2,4,8}``) spawns one
process a rank and times the step with its real collectives (``ranks.py``): one
rank per GPU over NCCL; ``--one-gpu``, every rank on cuda:0 over gloo (an
emulation, never a speed claim; its layout by priority, not timed); on the CPU over
gloo, a smoke run.

| module | holds |
| --- | --- |
| configs.py | the named configs |
| steer.py | weights of a shard, the filled KV cache, routing control, the executor's blocks one by one, the candidates' blocks |
| baseline.py | the torch baseline (reference math, FlashInfer paged attention) |
| timing.py | capture once, time each replay alone after an L2 flush |
| floor.py | bytes per block, copy bandwidth |
| runner.py | one config end to end, into a record |
| ranks.py | a config of every rank: one process a rank, the step with its collectives and detached, rank 0's record |
| report.py | table, JSON, PNG |
| clockwatch.py | the GPU's clocks, power and clock-event reasons sampled by nvidia-smi over phases |
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path

import torch

from ..arguments import at_least, device_of, parse_pins
from ..plugins import discover, provider_class
from ..spec import read_json
from .clockwatch import ClockWatch, ClockWatchError, nvidia_smi_index
from .configs import ROUTINGS, ROWS, BenchConfigError, check_max_context, named
from .report import PlotUnavailableError, plot, stem, table, write
from .runner import Progress, run
from .steer import CANDIDATE_KINDS

DEFAULT_OUT = Path("bench/results")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` on the CLI's subcommands."""
    p = sub.add_parser("bench", help="time the torch baseline and the executor against the memory floor")
    p.add_argument(
        "config",
        nargs="?",
        help="tiny, tp1-real-L2, tp8-rank-L<N>-bf16, -nvfp4 or -nvfp4-marlin (vLLM's SM90 Marlin layout), or "
        "tp8-rank-Lmax-...; every rank: tp{2,4,8}-L<N>-bf16, -nvfp4 or -nvfp4-marlin, tiny-tp{2,4,8} "
        "(or -nvfp4-marlin) (ranks.py); "
        "any TP name with -sharded (the pooler and the unpooler column-sharded); "
        "streams-tp8-rank, streams-tp8-rank-sharded or streams-tp1 (streams.py)",
    )
    p.add_argument(
        "--context",
        type=at_least(ROWS + 1),
        action="append",
        help="a context length (repeatable; default: the config's)",
    )
    p.add_argument(
        "--max-context",
        type=at_least(ROWS + 1),
        default=None,
        help="the executor's max context, as vLLM's max_model_len sets it when served (at least every context; "
        "default: each context itself). Providers that size themselves at build (split counts, plans) then "
        "run the shorter contexts as served",
    )
    p.add_argument("--routing", choices=ROUTINGS, action="append", help="random or correlated (default: both)")
    p.add_argument(
        "--replays", type=at_least(1), default=None, help="timed replays of each step (default 100; 3 on the CPU)"
    )
    p.add_argument("--block-replays", type=at_least(1), default=None, help="timed replays of each block (default 30)")
    p.add_argument("--no-blocks", action="store_true", help="skip the per-block graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--pin", action="append", default=[], metavar="BLOCK=PROVIDER")
    p.add_argument(
        "--provider",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="step configs: a provider class no pack registers, offered to the resolver and to --pin (repeatable)",
    )
    p.add_argument(
        "--candidates",
        choices=CANDIDATE_KINDS,
        action="append",
        default=[],
        help="also time every provider that supports this kind, per layer, each alone in a graph (repeatable)",
    )
    p.add_argument(
        "--one-gpu",
        action="store_true",
        help="configs of every rank: all ranks on cuda:0 over gloo (an emulation, not a speed claim; "
        "the layout by priority, not timed)",
    )
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="configs of every rank: the process group's backend (default: nccl with one rank per GPU, else gloo)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON record (and PNG) go")
    p.add_argument("--plot", action="store_true", help="also a PNG of the per-block times beside their floors")
    p.add_argument("--plot-from", type=Path, default=None, metavar="RECORD", help="only plot an existing JSON record")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--part",
        choices=("linear", "experts"),
        default=None,
        help="streams configs: only the dense weights or only the routed experts (default both)",
    )
    p.add_argument(
        "--linear-provider",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="streams configs: also measure this linear provider class, registered or not (repeatable)",
    )
    p.add_argument(
        "--experts-provider",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="streams-tp8-rank: also measure this routed-experts provider class, registered or not (repeatable)",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="sample the GPU's SM clock, power and clock-event reasons (nvidia-smi) through the executor's timed "
        "replays, into the record (configs of one rank, on a GPU)",
    )
    p.set_defaults(run=main)
    return p


def main(args: argparse.Namespace) -> int:
    if args.plot_from is not None:
        try:
            record = read_json(args.plot_from, BenchConfigError)
            if not isinstance(record, dict) or "runs" not in record:
                raise BenchConfigError(f"{args.plot_from} is not a sparkdecode bench record (no runs)")
            path = plot(record, args.plot_from.with_suffix(".png"))
        except (PlotUnavailableError, BenchConfigError) as e:
            print(f"sparkdecode bench: {e}", file=sys.stderr)
            return 2
        print(f"plot: {path}")
        return 0
    pins = parse_pins(args.pin)
    if args.out.exists() and not args.out.is_dir():
        print(f"sparkdecode bench: --out {args.out} is not a folder", file=sys.stderr)
        return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # checked before the run, so no record is lost at its end
        print(f"sparkdecode bench: --out {args.out}: {e}", file=sys.stderr)
        return 2
    if not args.config:
        print(
            "sparkdecode bench: name a config (tiny, tp1-real-L2, tp8-rank-L<N>-bf16) or --plot-from", file=sys.stderr
        )
        return 2
    if args.config.startswith("streams-"):
        if args.watch:
            print(f"sparkdecode bench: --watch is for the step's configs, not {args.config}", file=sys.stderr)
            return 2
        from .streams import main as streams_main

        return streams_main(args)
    try:
        cfg = named(args.config)
        if not cfg.all_ranks and (args.one_gpu or args.backend):
            raise BenchConfigError(f"--one-gpu and --backend are for configs of every rank, not {cfg.name}")
        if cfg.all_ranks and args.provider:
            raise BenchConfigError(f"--provider is for configs of one rank, not {cfg.name}")
        if cfg.all_ranks and args.watch:
            raise BenchConfigError(f"--watch is for configs of one rank, not {cfg.name}")
    except BenchConfigError as e:
        print(f"sparkdecode bench: {e}", file=sys.stderr)
        return 2
    argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else [args.config]
    command = "sparkdecode bench " + shlex.join(argv)
    if cfg.all_ranks:
        from .ranks import main as ranks_main

        return ranks_main(cfg, args, command)
    try:
        registry = discover().adding([provider_class(p) for p in args.provider])
    except (ValueError, ImportError, AttributeError) as e:  # no class there, no provider, or a name taken
        print(f"sparkdecode bench: --provider: {e}", file=sys.stderr)
        return 2
    device = device_of(args.device)
    try:
        spec = cfg.spec()
        for context in args.context or ():
            if context > spec.max_position_embeddings:
                raise BenchConfigError(
                    f"context {context} is above {cfg.name}'s {spec.max_position_embeddings} positions"
                )
        check_max_context(args.max_context, tuple(args.context or cfg.contexts), spec.max_position_embeddings)
        if cfg.layers == 0:
            if device.type != "cuda":
                raise BenchConfigError(f"{cfg.name} sizes itself to a GPU's memory")
            cfg = cfg.fitting(torch.cuda.mem_get_info(device)[0])
        if device.type == "cuda":
            cfg.check_fits(torch.cuda.mem_get_info(device)[0])
        if args.watch and device.type != "cuda":
            raise BenchConfigError("--watch samples a GPU's clocks: it needs --device cuda")
    except BenchConfigError as e:
        print(f"sparkdecode bench: {e}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        watch = None
        if args.watch:
            try:
                watch = stack.enter_context(ClockWatch(index=nvidia_smi_index(device)))
            except ClockWatchError as e:
                print(f"sparkdecode bench: --watch: {e}", file=sys.stderr)
                return 2
        record = run(
            cfg,
            device=device,
            contexts=tuple(args.context) if args.context else None,
            routings=tuple(dict.fromkeys(args.routing)) if args.routing else ROUTINGS,
            replays=args.replays,
            block_replays=args.block_replays,
            blocks=not args.no_blocks,
            seed=args.seed,
            max_context=args.max_context,
            pins=pins,
            candidates=tuple(dict.fromkeys(args.candidates)),
            registry=registry,
            command=command,
            progress=Progress(cfg.name, quiet=args.quiet),
            watch=watch,
        )
    path = write(record, args.out)
    print(table(record))
    print(f"record: {path}")
    if args.plot:
        try:
            print(f"plot: {plot(record, args.out / f'{stem(record)}.png')}")
        except PlotUnavailableError as e:
            print(f"no plot: {e}")
    return 0
