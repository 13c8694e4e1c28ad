"""Parameter server: core, policies, wire protocol, server, client, shards, overlap, checkpoints.  Imports no pyspark."""
