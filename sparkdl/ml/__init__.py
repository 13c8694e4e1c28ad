"""pyspark.ml front end: TorchEstimator and TorchModel (the only place importing pyspark.ml)."""
