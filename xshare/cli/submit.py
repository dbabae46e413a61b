"""``xshare submit`` and ``xshare ctl``: clients of a running ``xshare serve`` (no jax).

``submit`` expands a spec (or ``module:function --set k=v``) into jobs as plain data, sends
them, and prints one name per line (what ``ctl`` and ``top`` call them). Exit codes: 0 done,
1 the service refused (its message), 2 a usage error or no service to talk to.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2
ACTIONS = ("pause", "resume", "cancel", "priority")


def _client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", metavar="HOST:PORT",
                        help="the service (default: the only `xshare serve` of this user, from its discovery file)")
    parser.add_argument("--token", help="the service's control token (default: $XSHARE_TOKEN, else its discovery file)")


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="SPEC.toml | module:function",
                        help="a TOML launch spec ([runtime] is ignored: the service owns it), or a factory")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="K=V[,V...]",
                        help="a factory parameter; a comma list sweeps it (as in xshare launch)")
    parser.add_argument("--steps", type=int, help="steps per job (overrides the spec)")
    parser.add_argument("--json", action="store_true", help="print the service's answer as JSON")
    _client_arguments(parser)


def add_ctl_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS + ("list",), help="what to do")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="job names (for priority: NAME PRIORITY); none for list")
    _client_arguments(parser)


def add_deploy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("entry", metavar="module:function", help="a model factory returning xshare.model(...)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="K=V",
                        help="a factory parameter (one value each)")
    parser.add_argument("--name", help="the model's name (default: the factory's)")
    parser.add_argument("--version", type=int, metavar="V",
                        help="deploy it as version V of its name, beside the versions deployed (default: the "
                             "factory's, 1); requests naming no version go to the highest ready one")
    _client_arguments(parser)


def add_undeploy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the deployed model's name")
    parser.add_argument("--version", type=int, metavar="V",
                        help="undeploy only version V (default: every version); the others keep serving")
    _client_arguments(parser)


def run_deploy(args: argparse.Namespace) -> int:
    from xshare._errors import SpecError
    from xshare.service import client
    from xshare.service.models import from_cli

    try:
        request = from_cli(args.entry, args.sets, args.name, args.version)
    except SpecError as err:
        return _fail("deploy", str(err), EXIT_USAGE)
    try:
        answer = client.deploy(client.find(args.address, args.token), request)
    except client.ClientError as err:
        return _fail("deploy", str(err), EXIT_REFUSED if err.code is not None else EXIT_USAGE)
    print(answer["model"])
    return EXIT_OK


def run_undeploy(args: argparse.Namespace) -> int:
    from xshare.service import client

    try:
        client.undeploy(client.find(args.address, args.token), args.name, args.version)
    except client.ClientError as err:
        return _fail("undeploy", str(err), EXIT_REFUSED if err.code is not None else EXIT_USAGE)
    print(f"{args.name}: undeployed" if args.version is None else f"{args.name} version {args.version}: undeployed")
    return EXIT_OK


def run_submit(args: argparse.Namespace) -> int:
    from xshare._errors import SpecError
    from xshare.service import client
    from xshare.jobs import plan_target, requests_from_plan

    try:
        requests = requests_from_plan(plan_target(args.target, args.sets, args.steps))
    except SpecError as err:
        return _fail("submit", str(err), EXIT_USAGE)
    try:
        svc = client.find(args.address, args.token)
        answer = client.submit(svc, requests)
    except client.ClientError as err:
        if err.code is not None and isinstance(err.payload, dict) and args.json:
            import json
            print(json.dumps(err.payload, indent=2))
        return _fail("submit", str(err), EXIT_REFUSED if err.code is not None else EXIT_USAGE)
    if args.json:
        import json
        print(json.dumps({"address": svc.address, "jobs": answer}, indent=2))
    else:
        for job in answer:
            print(job["name"])
    return EXIT_OK


def run_ctl(args: argparse.Namespace) -> int:
    from xshare.service import client

    try:
        svc = client.find(args.address, args.token)
        if args.action == "list":
            for j in client.jobs(svc):
                total = "?" if j.get("steps_total") is None else j["steps_total"]
                print(f"{j['name']}\t{j['status']}\t{j['steps_done']}/{total}\tpriority {j['priority']}")
            return EXIT_OK
        if not args.names:
            return _fail("ctl", f"name the job(s) to {args.action}: xshare ctl {args.action} NAME [...]", EXIT_USAGE)
        if args.action == "priority":
            if len(args.names) != 2:
                return _fail("ctl", "write: xshare ctl priority NAME PRIORITY", EXIT_USAGE)
            try:
                priority = int(args.names[1])
            except ValueError:
                return _fail("ctl", f"priority {args.names[1]!r} is not a whole number", EXIT_USAGE)
            answer = client.control(svc, args.names[0], "priority", priority)
            print(f"{answer['job']}: priority {answer['priority']} ({answer['status']})")
            return EXIT_OK
        code = EXIT_OK
        for name in args.names:
            try:
                answer = client.control(svc, name, args.action)
                print(f"{answer['job']}: {args.action} ({answer['status']})")
            except client.ClientError as err:
                if err.code is None or err.code == 401:
                    raise
                print(f"xshare ctl: {name}: {err}", file=sys.stderr)
                code = EXIT_REFUSED
        return code
    except client.ClientError as err:
        return _fail("ctl", str(err), EXIT_REFUSED if err.code is not None else EXIT_USAGE)


def _fail(cmd: str, message: str, code: int) -> int:
    print(f"xshare {cmd}: error: {message}", file=sys.stderr)
    return code
