"""Any benchmark, this tree against another commit, in interleaved pairs.

    python bench/ab.py --baseline REF [--pairs 7] -- catchup.py --quick [its options]

Runs ``bench/<script>`` with its options ``--pairs`` times from this tree and
as many times from a worktree of REF (its bench, its package), one after the
other, the order alternating from pair to pair so that neither always runs
after the other's load. Each run prints its own figures beside its own
same-run baseline; this prints, for every figure of the run's ``result``
line that differs between runs, the median of this tree's, of the
baseline's, and of the pair-by-pair ratios (this tree / baseline): what
changed between the two commits, with the machine's drift cancelled pair
by pair. The two trees' result lines must have the same shape (the same
words around the figures); where they have not, both are printed and no
ratio is made up.

For benchmarks that run the publisher in a process of their own,
``fanout.py --baseline REF`` pairs rounds within one run, at less cost.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common import baseline_tree, paired, say, this_commit, tree_env

BENCH = Path(__file__).resolve().parent

_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
"""A figure in a result line: 12, 1,234,567, 0.96 (and the 0.96 of ``0.96x``)."""


@dataclass(frozen=True)
class Result:
    """A run's result line, split into its words and its figures."""

    line: str
    shape: str
    figures: tuple[float, ...]
    labels: tuple[str, ...]

    @classmethod
    def of(cls, output: str) -> Result:
        lines = [line for line in output.splitlines() if line.startswith("result")]
        if not lines:
            raise RuntimeError(f"no result line in the output:\n{output[-3000:]}")
        line = " ".join(lines)
        figures = tuple(float(n.replace(",", "")) for n in _NUMBER.findall(line))
        # What names a figure: the words around it, the other figures shown as #.
        words = _NUMBER.split(line)
        labels = tuple(
            f"{'#'.join(words[: i + 1])[-44:]}[]{'#'.join(words[i + 1 :])[:14]}".strip()
            for i in range(len(figures))
        )
        return cls(line, "#".join(words), figures, labels)


def run(script: str, options: Sequence[str], tree: Path | None) -> Result:
    """One run of ``bench/<script>``, from ``tree`` (None: this tree)."""
    bench = BENCH if tree is None else tree / "bench"
    done = subprocess.run(
        [sys.executable, str(bench / script), *options],
        cwd=bench,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        where = tree or "this tree"
        raise RuntimeError(f"{script} failed ({where}):\n{(done.stdout + done.stderr)[-3000:]}")
    return Result.of(done.stdout)


def report(ours: list[Result], theirs: list[Result]) -> None:
    if {r.shape for r in ours + theirs} != {ours[0].shape}:
        say("the result lines differ in shape between runs; no ratios (each run's line:)")
        for our, their in zip(ours, theirs, strict=True):
            say(f"  this tree: {our.line}\n  baseline:  {their.line}")
        return
    head = "figure ([] in its result line)"
    say(f"{head:<60} {'this tree':>12} {'baseline':>12} {'this / base':>12}")
    for i, label in enumerate(ours[0].labels):
        mine = [r.figures[i] for r in ours]
        base = [r.figures[i] for r in theirs]
        if len(set(mine + base)) == 1:
            continue  # a constant of the line (a count asked for, a target)
        ratio = paired(mine, base) if 0 not in base else float("nan")
        say(
            f"{label:<60} {statistics.median(mine):>12,.4g} "
            f"{statistics.median(base):>12,.4g} {ratio:>11.3f}x"
        )


def main(args: argparse.Namespace) -> None:
    script, *options = args.command
    with contextlib.ExitStack() as stack:
        tree, commit = stack.enter_context(baseline_tree(args.baseline))
        say(
            f"ab: {script} {' '.join(options)}: this tree {this_commit()} against "
            f"{args.baseline} ({commit}), {args.pairs} pairs"
        )
        ours: list[Result] = []
        theirs: list[Result] = []
        for n in range(args.pairs):
            order = [(ours, None), (theirs, tree)]
            for results, which in order if n % 2 == 0 else order[::-1]:
                results.append(run(script, options, which))
            say(f"  pair {n + 1}: this tree  {ours[-1].line}")
            say(f"  pair {n + 1}: baseline   {theirs[-1].line}")
    report(ours, theirs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--baseline", metavar="REF", required=True, help="the commit to pair with")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- SCRIPT [OPTIONS]: a benchmark of bench/"
    )
    args = parser.parse_args()
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("name a benchmark: ab.py --baseline REF -- catchup.py --quick")
    return args


if __name__ == "__main__":
    main(parse_args())
