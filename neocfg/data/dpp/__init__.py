"""DPP: a master that hands out splits, stateless workers that preprocess them, a client per trainer.

Modules: progress (positions, the split queue), worker (read + transform + batch one split), backend (the DppBackend
interface, the inline backend), local (worker processes + master thread), client (batches of exactly batch_size,
stall time), service (a backend with its clients), sizing (dsi.workers=auto).
"""
