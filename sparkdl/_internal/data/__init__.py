"""The data path: Arrow columns and RDD rows -> arrays, row checks, a worker's partition in memory or on disk, batches."""
