"""The `kvconform` command: environments, the main job, the release gate, report and dashboard."""

from __future__ import annotations

import argparse
import sys

from kvconform.errors import KvconformError, UsageError
from kvconform.processes import sigterm_as_interrupt

PROOF_HELP = (
    "mutants.json of `make mutants`: each check's page on a real engine lists what violated its "
    "measures there"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvconform", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="engine environments (one per engine, cached)")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    build = env_sub.add_parser("build", help="build (or reuse) an engine environment")
    build.add_argument("names", nargs="*", metavar="ENGINE")
    build.add_argument("--force", action="store_true", help="rebuild even if cached")
    build.add_argument(
        "--gpu",
        action="store_true",
        help="GPU specs (all without names): built where NVML sees a GPU, else only their pins resolved",
    )
    build.add_argument("--prune", action="store_true", help="remove stale builds of these specs")
    path = env_sub.add_parser("path", help="print a built environment's directory")
    path.add_argument("name", metavar="ENGINE")
    env_sub.add_parser("list", help="list specs and whether each is built")

    run = sub.add_parser("run", help="the main job: suites against an engine, with an Allure report")
    run.add_argument("--engine", action="append", default=[], help="engine (default: reference)")
    run.add_argument("--results-dir", default="results")
    run.add_argument("--report-dir", default="report")
    run.add_argument("--baseline", help="results of a baseline run: its gate verdict goes into the report")
    run.add_argument("--history", help="Allure history file (default: RESULTS_DIR/allure-history.jsonl)")
    run.add_argument(
        "--mutation-matrix", help="mutation-matrix.json of the self-tests: each check's page lists its kills"
    )
    run.add_argument("--proof", help=PROOF_HELP)
    run.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments after --")

    gate = sub.add_parser("gate", help="compare a candidate's results with a baseline's")
    gate.add_argument("baseline")
    gate.add_argument("candidate")
    gate.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    gate.add_argument(
        "--block-on",
        action="append",
        metavar="CLASS",
        help="finding classes whose new appearance blocks (repeatable; default: defect, "
        "known-upstream; the others are listed apart)",
    )

    report = sub.add_parser("report", help="turn Allure results into an HTML report")
    report.add_argument("allure_results")
    report.add_argument("--out", default="report")
    report.add_argument("--results", help="the run's results dir (results.json): organises the report")
    report.add_argument("--baseline", help="with --results: show the gate against this baseline")
    report.add_argument("--history", help="Allure history file to read and append to (trends)")
    report.add_argument(
        "--mutation-matrix", help="with --results: mutation-matrix.json, each check's page lists its kills"
    )
    report.add_argument("--proof", help="with --results: " + PROOF_HELP)

    dash = sub.add_parser("dashboard", help="engine x check conformance dashboard from results.json")
    dash.add_argument("results_dir", metavar="RESULTS_DIR")
    dash.add_argument("--html", help="where dashboard.html goes (default: RESULTS_DIR/dashboard.html)")
    repro = sub.add_parser("repro", help="run a defect's standalone reproduction in its engine's environment")
    repro.add_argument("engine", nargs="?", metavar="ENGINE")
    repro.add_argument("finding", nargs="?", metavar="FINDING", help="the defect's name (see --list)")
    repro.add_argument("--list", action="store_true", help="list the defects that have a repro")
    repro.add_argument("--timeout", type=float, default=600.0, help="seconds before the repro is stopped")
    repro.add_argument("--env", help="the environment spec to run it in (default: the engine's)")
    inv = sub.add_parser("inventory", help="engine x capability inventory, cited (docs/inventory.md)")
    inv.add_argument("--out", default="docs/inventory.md", help="where the table goes")
    mut = sub.add_parser("mutants", help="run the engines' mutants and write the per-engine proof table")
    mut.add_argument("--engine", action="append", default=[], help="engine (default: every one with mutants)")
    mut.add_argument("--mutant", action="append", default=[], help="only these mutants (default: all)")
    mut.add_argument(
        "--judged",
        action="append",
        default=[],
        help="results dir of a full run (repeatable): every measure "
        "it judged on an engine goes in that engine's table",
    )
    mut.add_argument("--clean-from", help="a finished clean run's results dir: run only the mutant sessions")
    mut.add_argument(
        "--reuse", action="store_true", help="keep sessions already recorded under --work (rewrite the table)"
    )
    mut.add_argument(
        "--reasons",
        action="store_true",
        help="only rewrite the table at --out with each engine's unproven reasons from its catalog",
    )
    mut.add_argument(
        "--merge",
        action="store_true",
        help="merge into the table at --out (these mutants replace their rows)",
    )
    mut.add_argument("--work", default="results/mutants", help="where each session's results go")
    mut.add_argument("--out", default="docs/mutants.md", help="the proof table (and .json beside it)")
    mut.add_argument(
        "--history",
        default="docs/history.json",
        help="the release-history verdicts (`kvconform history`): a caught bug proves its measure",
    )
    mut.add_argument("--timeout", type=float, default=1800.0, help="seconds one session may take")
    from kvconform import bisect
    from kvconform.history import runner as history

    bisect.add_arguments(sub.add_parser("bisect", help="first release where a check changed"))
    history.add_arguments(
        sub.add_parser(
            "history", help="shipped bugs: fail the bad release, pass the fixed one (docs/history.md)"
        )
    )

    args = parser.parse_args(argv)
    sigterm_as_interrupt()  # a killed `kvconform mutants` or `history` stops its child sessions
    try:
        if args.command == "bisect":
            return bisect.run_cli(args)
        return history.run_cli(args) if args.command == "history" else _dispatch(args)
    except KvconformError as exc:
        print(f"kvconform: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "env":
        from kvconform import envs

        if args.env_command == "build":
            if args.gpu:
                return envs.build_gpu(args.names, force=args.force)
            if not args.names:
                raise UsageError("env build: name at least one spec (or --gpu for all GPU specs)")
            for name in [spec for n in args.names for spec in envs.specs_to_build(n)]:
                envs.build(name, force=args.force)
                if args.prune:
                    envs.prune(name)
        elif args.env_command == "path":
            print(envs.find(args.name).spec.directory)
        else:
            for name in envs.known_specs():
                spec = envs.load_spec(name)
                state = "built" if (spec.directory / envs.MARKER).exists() else "not built"
                print(f"{name:20s} {state:10s} {spec.directory}")
        return 0
    if args.command == "run":
        from kvconform.mainjob import run_main_job

        return run_main_job(
            args.engine or ["reference"],
            args.results_dir,
            args.report_dir,
            [a for a in args.pytest_args if a != "--"],
            baseline=args.baseline,
            history=args.history,
            mutation_matrix=args.mutation_matrix,
            proof=args.proof,
        )
    if args.command == "gate":
        from kvconform.findings import CLASSES
        from kvconform.gate import BLOCKING_CLASSES, run_gate

        block_on = BLOCKING_CLASSES
        if args.block_on:
            unknown = sorted(set(args.block_on) - set(CLASSES))
            if unknown:
                raise UsageError(f"--block-on {', '.join(unknown)}: want one of {', '.join(CLASSES)}")
            block_on = frozenset(args.block_on) | {"unclassified"}
        return run_gate(args.baseline, args.candidate, markdown=args.markdown, block_on=block_on)
    if args.command == "report":
        from pathlib import Path

        if args.results:
            from kvconform.mainjob import build_report

            print(
                build_report(
                    Path(args.allure_results),
                    Path(args.results),
                    Path(args.out),
                    args.baseline,
                    args.history,
                    args.mutation_matrix,
                    args.proof,
                )
            )
            return 0
        from kvconform.allure_html import generate

        if args.baseline:
            raise UsageError("--baseline needs --results (the candidate's results dir)")
        print(generate(args.allure_results, args.out, history=args.history))
        return 0
    if args.command == "repro":
        from kvconform import repro as repros

        if args.list or not args.finding:
            print(repros.list_defects(args.engine))
            return 0
        return repros.run(args.engine, args.finding, timeout_s=args.timeout, env=args.env)
    if args.command == "mutants":
        from kvconform.mutants.runner import run_cli

        return run_cli(args)
    if args.command == "inventory":
        from pathlib import Path

        from kvconform import inventory

        print(inventory.write(Path(args.out)))
        return 0
    if args.command == "dashboard":
        from kvconform import dashboard

        md, html = dashboard.write(args.results_dir, args.html)
        print(md.read_text(), end="")
        print(f"kvconform dashboard: {md}, {html}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
