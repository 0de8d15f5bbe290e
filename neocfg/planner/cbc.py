"""Running PuLP's bundled CBC: time limit, relative gap, warm start; reads back the proven bound from CBC's log."""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import pulp


@dataclass(frozen=True)
class CbcOutcome:
    status: str               # optimal | feasible (stopped with a solution) | infeasible | not_solved
    objective: Optional[float]
    bound: Optional[float]    # proven lower bound on the objective (minimization)
    seconds: float


def var(prob: pulp.LpProblem, name: str, cat: str = "Continuous", low: Optional[float] = None) -> pulp.LpVariable:
    """A variable of `prob` (PuLP >= 3.3 attaches it to the model; older PuLP builds it directly)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def solve(prob: pulp.LpProblem, time_limit_s: float, gap: float, warm: bool) -> CbcOutcome:
    fd, log = tempfile.mkstemp(prefix="neocfg-cbc-", suffix=".log")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # PuLP 3.x announces PULP_CBC_CMD's move; the bundled CBC is what we want
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit_s))), gapRel=gap,
                                       warmStart=warm, logPath=log, threads=1)
        try:
            prob.solve(solver)
        except pulp.PulpSolverError:
            return CbcOutcome("not_solved", None, None, time.perf_counter() - t0)
        text = open(log).read()
    finally:
        try:
            os.unlink(log)
        except OSError:
            pass
    seconds = time.perf_counter() - t0
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        return CbcOutcome("infeasible", None, None, seconds)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return CbcOutcome("not_solved", None, _bound(text), seconds)
    objective = pulp.value(prob.objective)
    optimal = "Result - Optimal solution found" in text
    bound = _bound(text)
    if bound is None and optimal:
        bound = objective * (1 - gap) if "tolerance" in text else objective
    return CbcOutcome("optimal" if optimal else "feasible", objective, bound, seconds)


def _bound(text: str) -> Optional[float]:
    m = re.search(r"^Lower bound:\s*(-?[0-9.eE+-]+)", text, re.MULTILINE)
    return float(m.group(1)) if m else None
