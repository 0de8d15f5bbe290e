"""Interoperation with other sharding systems (TorchRec): neocfg.interop.export (plain data, no TorchRec) and
neocfg.interop.torchrec (NeocfgShardingPlanner; needs TorchRec)."""
