"""Running PuLP's bundled CBC: time limit, relative gap, warm start; reads back the proven bound from CBC's log."""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional

import pulp

# A solver's proven bound can exceed the exact optimum by its tolerances: integrality 1e-6 (a binary at 1 - 1e-6
# leaves a millionth of a piece's time on another option) and primal feasibility 1e-7, CBC's and HiGHS's defaults;
# the bound handed on is lowered by this fraction of its size.
SOLVER_BOUND_SLACK = 1e-5


@dataclass(frozen=True)
class MipOutcome:
    """What a MIP solve hands back (CBC here, HiGHS in highs.py)."""

    status: str               # optimal | feasible (stopped with a solution) | infeasible | not_solved
    objective: Optional[float]
    bound: Optional[float]    # proven lower bound on the objective (minimization)
    seconds: float
    # Seconds into the solve when the best solution was first found (None: not known, as from HiGHS).
    found_s: Optional[float] = None


def var(prob: pulp.LpProblem, name: str, cat: str = "Continuous", low: Optional[float] = None) -> pulp.LpVariable:
    """A variable of `prob` (PuLP >= 3.3 attaches it to the model; older PuLP builds it directly)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def row(prob: pulp.LpProblem, terms: Iterable[tuple[pulp.LpVariable, float]], sense: int, rhs: float,
        name: Optional[str] = None) -> pulp.LpConstraint:
    """Add sum(coef x var) <sense> rhs to `prob` in one go (no intermediate expressions: lpSum over c * x builds one
    per product, which dominates building models with a million nonzeros). Each variable at most once in terms.
    Returns the row (the model holds this object: changeRHS on it changes the model)."""
    constraint = pulp.LpConstraint(pulp.LpAffineExpression(list(terms)), sense=sense, rhs=rhs, name=name)
    prob.addConstraint(constraint)
    return constraint


def solve(prob: pulp.LpProblem, time_limit_s: float, gap: float, warm: bool, relax: bool = False) -> MipOutcome:
    """relax: solve the LP relaxation (integrality dropped): its optimum is a proven bound on the MIP's."""
    fd, log = tempfile.mkstemp(prefix="neocfg-cbc-", suffix=".log")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # PuLP 3.x announces PULP_CBC_CMD's move; the bundled CBC is what we want
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit_s))), gapRel=gap,
                                       warmStart=warm and not relax, logPath=log, threads=1, mip=not relax)
        try:
            prob.solve(solver)
        except pulp.PulpSolverError:
            return MipOutcome("not_solved", None, None, time.perf_counter() - t0)
        text = open(log).read()
    finally:
        try:
            os.unlink(log)
        except OSError:
            pass
    seconds = time.perf_counter() - t0
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        return MipOutcome("infeasible", None, None, seconds)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return MipOutcome("not_solved", None, slack(_bound(text)), seconds)
    objective = pulp.value(prob.objective)
    if relax:
        return MipOutcome("optimal" if status == "Optimal" else "not_solved", objective,
                          slack(objective) if status == "Optimal" else None, seconds)
    optimal = "Result - Optimal solution found" in text
    bound = _bound(text)
    if bound is None and optimal:
        bound = objective * (1 - gap) if "tolerance" in text else objective
    return MipOutcome("optimal" if optimal else "feasible", objective, slack(bound), seconds, _found_s(text))


def _found_s(text: str) -> Optional[float]:
    """When CBC's log first reports its best solution ("Integer solution of <objective> ... (<t> seconds)")."""
    found = [(float(obj), float(t)) for obj, t in _SOLUTION.findall(text)]
    if not found:
        return None
    best = min(obj for obj, _ in found)
    return min(t for obj, t in found if obj <= best)


def slack(bound: Optional[float]) -> Optional[float]:
    return None if bound is None else bound - SOLVER_BOUND_SLACK * abs(bound)


_SOLUTION = re.compile(r"^Cbc00(?:04|12)I Integer solution of (\S+) .*\(([0-9.]+) seconds\)", re.MULTILINE)


def _bound(text: str) -> Optional[float]:
    """CBC's "Lower bound:" line, which it prints rounded (to 3 decimals): the low end of what rounds to it."""
    m = re.search(r"^Lower bound:\s*(-?[0-9.]+)([eE][+-]?[0-9]+)?", text, re.MULTILINE)
    if not m:
        return None
    mantissa, exponent = m.group(1), m.group(2) or "e0"
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return (float(mantissa) - 0.5 * 10.0 ** -decimals) * 10.0 ** int(exponent[1:])
