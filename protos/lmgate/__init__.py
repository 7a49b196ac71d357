"""lmgate: the package root. `lmgate.v1` holds the stubs generated from protos/lmgate/v1/*.proto."""
