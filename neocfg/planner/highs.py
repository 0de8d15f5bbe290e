"""Running HiGHS (highspy) on a PuLP model: the model is handed over in bulk (one addCols, one addRows: PuLP's own
HiGHS interface adds them one call each), the warm start as a full solution, and the proven bound read from HiGHS's
info (mip_dual_bound) rather than from a log."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import pulp

from neocfg.planner.cbc import MipOutcome, slack


def solve(prob: pulp.LpProblem, time_limit_s: float, gap: float, warm: bool, relax: bool = False) -> MipOutcome:
    """relax: solve the LP relaxation (integrality dropped): its optimum is a proven bound on the MIP's."""
    import highspy

    t0 = time.perf_counter()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(max(1.0, time_limit_s)))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("threads", 1)
    variables = prob.variables()
    index = {v.name: i for i, v in enumerate(variables)}
    inf = highspy.kHighsInf
    n = len(variables)
    cost = np.array([prob.objective.get(v, 0.0) for v in variables], dtype=np.float64)
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=np.float64)
    upper = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=np.float64)
    h.addCols(n, cost, lower, upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    ints = np.array([i for i, v in enumerate(variables) if v.cat == pulp.LpInteger], dtype=np.int32)
    if len(ints) and not relax:
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    rows_lo, rows_hi, starts, cols, vals = [], [], [], [], []
    listed = prob.constraints
    for c in (listed() if callable(listed) else listed.values()):   # PuLP >= 3.3: a call; older: a dict
        starts.append(len(cols))
        for v, a in c.items():
            if a != 0:
                cols.append(index[v.name])
                vals.append(a)
        lo, hi = c.getLb(), c.getUb()
        rows_lo.append(-inf if lo is None else lo)
        rows_hi.append(inf if hi is None else hi)
    h.addRows(len(rows_lo), np.array(rows_lo, np.float64), np.array(rows_hi, np.float64), len(cols),
              np.array(starts, np.int32), np.array(cols, np.int32), np.array(vals, np.float64))
    h.changeObjectiveOffset(float(prob.objective.constant))
    if warm and not relax:
        sol = highspy.HighsSolution()
        sol.col_value = [float(v.varValue or 0.0) for v in variables]
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    seconds = time.perf_counter() - t0
    status = h.getModelStatus()
    info = h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        return MipOutcome("infeasible", None, None, seconds)
    if relax:
        optimal = status == highspy.HighsModelStatus.kOptimal
        if optimal:
            for v, x in zip(variables, h.getSolution().col_value):
                v.varValue = x
        objective = info.objective_function_value if optimal else None
        return MipOutcome("optimal" if optimal else "not_solved", objective,
                          slack(objective) if optimal else None, seconds)
    bound: Optional[float] = info.mip_dual_bound if np.isfinite(info.mip_dual_bound) else None
    if info.primal_solution_status != 2:   # kSolutionStatusFeasible
        return MipOutcome("not_solved", None, slack(bound), seconds)
    for v, x in zip(variables, h.getSolution().col_value):
        v.varValue = x
    optimal = status == highspy.HighsModelStatus.kOptimal
    return MipOutcome("optimal" if optimal else "feasible", info.objective_function_value, slack(bound), seconds)
