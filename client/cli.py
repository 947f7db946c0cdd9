"""The `halfmoon` command line: one subcommand per job, each implemented in its own module."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> "module:function"; the function takes the parsed args and returns an exit code.
COMMANDS = {
    "generate": "client.generate_cmd:run",
    "serve": "deploy.serve_cmd:run",
    "status": "client.status_cmd:run",
    "replay": "client.replay_cmd:run",
    "demo": "deploy.demo:run",
    "fetch": "model.fetch:run",
    "simulate": "sim.cli:simulate_cmd",
    "fit-profile": "sim.cli:fit_profile_cmd",
    "plan": "sim.plan_cmd:plan_cmd",
    "make-certs": "client.cli:make_certs_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="halfmoon", description="Disaggregated prefill/decode LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    address_help = "conductor address HOST:PORT (default: $HALFMOON_ADDRESS or 127.0.0.1:50050)"
    default_address = os.environ.get("HALFMOON_ADDRESS", "127.0.0.1:50050")

    g = sub.add_parser(
        "generate", help="generate a completion (on a cluster, or --local in this process)"
    )
    g.add_argument("prompt")
    g.add_argument(
        "--local", action="store_true", help="run the model in this one process (the reference)"
    )
    g.add_argument("--address", default=default_address, help=address_help)
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--json", action="store_true", help="print machine-readable records")
    _add_access_args(g)

    s = sub.add_parser(
        "serve",
        help="start the cluster with Ray and print the conductor's address (and the HTTP API's)",
    )
    s.add_argument(
        "--config", default=None, help="cluster config YAML (default: deploy/configs/local.yaml)"
    )
    s.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value"
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="join a running Ray cluster ('auto') instead of starting one",
    )
    s.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="port of the OpenAI-compatible HTTP API (default: the config's http_port, 8000 in "
        "local.yaml); 0 = no HTTP server",
    )
    s.add_argument(
        "--metrics",
        nargs="?",
        const="",
        default=None,
        metavar="TARGETS_FILE",
        help="export Prometheus metrics from every server (ports from metrics_base_port, 9100 "
        "when unset), print the scrape targets and write them for Prometheus' file_sd "
        "(default file: deploy/prometheus/targets/halfmoon.json)",
    )

    st = sub.add_parser("status", help="print the cluster's workers, loads and store occupancy")
    st.add_argument("--address", default=default_address, help=address_help)
    st.add_argument("--json", action="store_true")
    _add_access_args(st)

    r = sub.add_parser("replay", help="replay a request trace against a running cluster and report")
    r.add_argument("trace")
    r.add_argument("--address", default=default_address, help=address_help)
    r.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"])
    r.add_argument("--limit", type=int, default=None)
    r.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply inter-arrival times by this"
    )
    r.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply prompt and block lengths by this"
    )
    r.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    r.add_argument("--policy", default="")
    r.add_argument(
        "--compare-policies",
        default="",
        help="comma-separated policies, replayed one after another",
    )
    r.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per policy, the policies in alternating order (A B, then B A)",
    )
    r.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    r.add_argument(
        "--tbt-slo-ms",
        type=float,
        default=200.0,
        help="TBT objective (mean of a request's slowest 10%% of gaps); 0 = not judged, and the "
        "conductor's default sent",
    )
    r.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=0.0,
        help="TPOT objective (the mean gap, as vLLM's bench judges); 0 = not judged, and the "
        "conductor's default sent",
    )
    r.add_argument("--max-input", type=int, default=None, help="cap prompt lengths (after scaling)")
    r.add_argument(
        "--vocab-size", type=int, default=0, help="token ids drawn below this (0: ask the cluster)"
    )
    r.add_argument("--seed", type=int, default=0, help="seed of the hash-id -> token runs")
    r.add_argument("--output", default="runs/replay")

    d = sub.add_parser(
        "demo", help="the main job: local cluster, a chat answer, a replayed trace slice, a report"
    )
    d.add_argument("--config", default=None)
    d.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value"
    )
    d.add_argument(
        "--limit",
        type=int,
        default=None,
        help="trace requests to replay (default: sized for 2 CPUs)",
    )
    d.add_argument(
        "--trace", default=None, help="trace to replay (default: the shipped Mooncake trace)"
    )
    d.add_argument("--time-scale", type=float, default=None)
    d.add_argument("--length-scale", type=float, default=None)
    d.add_argument("--max-output", type=int, default=None)
    d.add_argument("--policies", default="mooncake,cache_off")
    d.add_argument(
        "--repeats", type=int, default=2, help="runs per policy, in alternating order"
    )
    d.add_argument("--output", default="runs/demo")

    mc = sub.add_parser(
        "make-certs",
        help="make a throwaway CA and a node certificate (for tests and local trials of TLS)",
    )
    mc.add_argument("directory", help="where ca.pem, node.pem and node.key are written")
    mc.add_argument(
        "--host",
        action="append",
        default=None,
        help="an IP or DNS name the certificate is valid for (repeatable; default: 127.0.0.1 "
        "and localhost)",
    )
    mc.add_argument("--days", type=int, default=30)

    f = sub.add_parser("fetch", help="fetch a model into the local cache")
    f.add_argument("name", nargs="?", default="smollm2-135m")
    from sim.cli import add_fit_args, add_simulate_args

    add_simulate_args(
        sub.add_parser(
            "simulate",
            help="simulate a cluster on a trace with the conductor's policies (no model runs)",
        )
    )
    add_fit_args(
        sub.add_parser(
            "fit-profile",
            help="fit a simulator profile from `halfmoon replay` output or vLLM bench results",
        )
    )
    from sim.plan_cmd import add_plan_args

    pl = sub.add_parser(
        "plan", help="recommend a prefill:decode split for a trace and objectives (simulated)"
    )
    add_plan_args(pl)
    _add_access_args(pl)  # for --conductor
    return parser


def _add_access_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token", default=None, help="API token of a secured cluster (default: $HALFMOON_TOKEN)"
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        help="CA certificate (PEM) of a conductor serving TLS (default: $HALFMOON_TLS_CA)",
    )


def make_certs_cmd(args) -> int:
    from servekit import make_certs

    hosts = args.host or ["127.0.0.1", "localhost"]
    paths = make_certs(args.directory, hosts, days=args.days)
    print(f"ca: {paths.ca}\ncert: {paths.cert}\nkey: {paths.key}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The client library reads these (client.Access.from_env), whichever command builds it.
    for option, variable in (("token", "HALFMOON_TOKEN"), ("tls_ca", "HALFMOON_TLS_CA")):
        if getattr(args, option, None) is not None:
            os.environ[variable] = getattr(args, option)
    module_name, func_name = COMMANDS[args.command].split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints one clear line, never a traceback
        if os.environ.get("HALFMOON_DEBUG"):
            raise
        print(f"error: {_describe(exc)}", file=sys.stderr)
        return 2


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)  # grpc.RpcError carries its status message here
    if callable(details) and details():
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        return f"{code.name if code else 'RPC'}: {details()}"
    return str(exc) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
