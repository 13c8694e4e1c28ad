"""Parameter server: policies, wire protocol, server, client.  Imports no pyspark."""
