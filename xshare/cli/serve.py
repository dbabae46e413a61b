"""``xshare serve``: a long-running runtime that owns one device and takes jobs as plain data.

Thin: parse, build :class:`xshare.service.service.Service`, wait for SIGTERM/SIGINT, stop.
Exit codes: 0 stopped by a signal after checkpointing every live job (``--resume`` continues
them), 2 a usage error (nothing started).
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory", help="device memory the runtime may use: bytes, '2GiB', or 'device' (default)")
    parser.add_argument("--policy", default="pack", help="fifo, pack, srtf, fair or priority (default pack)")
    parser.add_argument("--address", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="where the control API listens (default 127.0.0.1:0 = loopback, any free port; "
                             "a non-loopback host exposes /status to the network, control still needs the token)")
    parser.add_argument("--grpc-port", type=int, metavar="PORT",
                        help="also serve the models over the Open Inference Protocol's gRPC (GRPCInferenceService, "
                             "as tritonclient.grpc speaks it) on this port of --address's host (0 = any free "
                             "port); needs pip install 'xshare[grpc]'")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="each job's metrics.jsonl, log.txt and checkpoint go under DIR/<job>/ "
                             "(default runs/{YYYYmmdd-HHMMSS}-serve)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the jobs of an earlier serve in --run-dir from their checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="N",
                        help="checkpoint each job every N steps, at its end and on SIGTERM (default 100; 0 = only then)")
    parser.add_argument("--fuse", action="store_true", help="run jobs that share a program as fused groups")
    parser.add_argument("--model", dest="models", action=_ModelArg, metavar="ENTRY",
                        help="deploy a model at start (a factory module:function returning xshare.model(...), "
                             "e.g. xshare.models.inference:make_model); repeat for more. Its --set options "
                             "follow it; served over the Open Inference Protocol at /v2/models/{name}")
    parser.add_argument("--model-repository", metavar="DIR",
                        help="serve the models of DIR, one folder per model with its config.toml (entry = "
                             "\"module:function\", [params]), as tritonserver --model-repository does; Triton's "
                             "repository API (/v2/repository/index, .../load, .../unload) manages them")
    parser.add_argument("--model-control-mode", choices=("none", "explicit", "poll"), default="none",
                        help="none (default): load every entry at start, refuse load/unload; explicit: load the "
                             "--load-model entries at start, load/unload by API; poll: load every entry and "
                             "rescan DIR every --repository-poll-secs (Triton's modes)")
    parser.add_argument("--load-model", action="append", default=[], metavar="NAME",
                        help="with --model-control-mode explicit: an entry to load at start ('*' = all); repeat")
    parser.add_argument("--repository-poll-secs", type=float, default=15.0, metavar="S",
                        help="with --model-control-mode poll: seconds between scans of DIR (default 15)")
    parser.add_argument("--set", dest="model_sets", action=_ModelArg, metavar="K=V",
                        help="a parameter of the --model before it")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--address {text!r} must be HOST:PORT with PORT in 0..65535 (e.g. 127.0.0.1:8470; "
                         "0 picks a free port)")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    import datetime as _dt
    import logging
    import signal
    from pathlib import Path

    from xshare._errors import XShareError

    try:
        host, port = parse_address(args.address)
    except ValueError as err:
        return _usage(str(err))
    if args.checkpoint_every < 0:
        return _usage(f"--checkpoint-every {args.checkpoint_every} must be >= 0")
    if args.grpc_port is not None:
        if not 0 <= args.grpc_port <= 65535:
            return _usage(f"--grpc-port {args.grpc_port} must be in 0..65535 (0 picks a free port)")
        from xshare.runtime.web.grpc_server import require_grpc
        try:  # before anything starts: a missing extra is a usage error naming it
            require_grpc()
        except XShareError as err:
            return _usage(str(err))
    repository = None
    if args.model_repository is not None:
        if not Path(args.model_repository).is_dir():
            return _usage(f"--model-repository {args.model_repository!r} is not a directory; give the directory "
                          "that holds one folder per model (each with its config.toml)")
        if args.load_model and args.model_control_mode != "explicit":
            return _usage("--load-model needs --model-control-mode explicit")
        if args.repository_poll_secs <= 0:
            return _usage(f"--repository-poll-secs {args.repository_poll_secs} must be > 0")
        repository = {"directory": args.model_repository, "mode": args.model_control_mode,
                      "load": tuple(args.load_model), "poll_s": args.repository_poll_secs}
    elif args.load_model or args.model_control_mode != "none":
        return _usage("--model-control-mode and --load-model need --model-repository DIR")
    if args.resume and not args.run_dir:
        return _usage("--resume needs the --run-dir of the service to continue")
    from xshare.cli.spec import policies

    if args.policy not in policies():
        return _usage(f"--policy {args.policy!r} is not a policy; choose one of: {', '.join(policies())}")
    try:
        models = _model_requests(getattr(args, "model_args", None) or [])
    except XShareError as err:
        return _usage(str(err))
    memory = None if args.memory in (None, "device", "none") else args.memory
    run_dir = Path(args.run_dir or f"runs/{_dt.datetime.now():%Y%m%d-%H%M%S}-serve")
    if "" not in sys.path:  # like launch: modules next to where the service runs resolve
        sys.path.insert(0, str(Path.cwd()))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    stop = threading.Event()
    old: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            print("xshare serve: already stopping (checkpointing every job)", file=sys.stderr, flush=True)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # before the runtime: no signal is lost while it starts
        old[sig] = signal.signal(sig, on_signal)
    from xshare.runtime.compiled.compiler import enable_persistent_cache
    from xshare.service.service import ANNOUNCE, Service

    enable_persistent_cache()
    try:
        svc = Service(run_dir=run_dir, memory=memory, policy=args.policy, host=host, port=port,
                      resume=args.resume, checkpoint_every=args.checkpoint_every or None, fuse=args.fuse,
                      models=models, grpc_port=args.grpc_port, repository=repository)
    except (ValueError, XShareError) as err:
        return _usage(f"cannot start the service: {err}")
    print(f"xshare serve: listening on http://{svc.address} (pid {__import__('os').getpid()}), "
          f"run dir {run_dir}, token in {run_dir / ANNOUNCE}"
          + (f", resumed {len(svc.resumed)} job(s)" if args.resume else "")
          + (f", models {', '.join(svc.deployed)} at /v2/models/NAME" if svc.deployed else "")
          + (f", gRPC on {svc.grpc.address}" if svc.grpc else "")
          + (f", model repository {args.model_repository} ({args.model_control_mode}): "
             f"{', '.join(sorted(svc.rt.models)) or 'nothing'} loaded" if svc.repository else ""), flush=True)
    while not stop.wait(timeout=0.5):
        pass
    print("xshare serve: stopping: finishing steps in flight and checkpointing every job ...", flush=True)
    missed = svc.stop()
    if missed:
        print(f"xshare serve: could not checkpoint {', '.join(missed)} in time", file=sys.stderr)
    print(f"xshare serve: stopped; continue with: xshare serve --resume --run-dir {run_dir}", flush=True)
    return EXIT_OK


class _ModelArg(argparse.Action):
    """``--model ENTRY``: a new (entry, sets) pair; ``--set K=V`` goes to the --model before it."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        pairs = list(getattr(namespace, "model_args", None) or [])
        if self.dest == "models":
            pairs.append((value, []))
        elif not pairs:
            parser.error(f"--set {value}: name the model first: --model ENTRY --set {value}")
        else:
            pairs[-1] = (pairs[-1][0], [*pairs[-1][1], value])
        namespace.model_args = pairs


def _model_requests(pairs: list[tuple[str, list[str]]]) -> list:
    from xshare.service.models import from_cli

    return [from_cli(entry, sets) for entry, sets in pairs]


def _usage(message: str) -> int:
    print(f"xshare serve: error: {message}", file=sys.stderr)
    return EXIT_USAGE
