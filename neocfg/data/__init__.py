"""Data: synthetic samples, Parquet datasets and the DPP service that feeds trainers."""
