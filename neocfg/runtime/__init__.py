"""The runtime: execute a Plan with torch.distributed and fused fbgemm embeddings, train a DLRM, checkpoint/resume."""
