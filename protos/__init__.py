"""The contract between ckptstage's client and daemon.

``ckptstage.protos.v1`` holds the gRPC service (generated, committed);
:mod:`ckptstage.protos.layout` holds what both sides must agree on about
checkpoints at rest: names, paths on a tier, the manifest and its checksums.
"""
