"""What-if sweeps: one summary (CSV, Markdown, PNG) across the runs of a Hydra multirun."""
