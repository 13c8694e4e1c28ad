"""Training modes: the driver side and the task body of each.

PS workers, allreduce, pipelines, executor-hosted PS shards; run results, summaries, progress.
"""
