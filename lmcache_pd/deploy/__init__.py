"""Everything that starts instances: pools files, the local launcher, Ray actors, Kubernetes
manifests and the vLLM server wrapper they all start.

Above the proxy and the connector: deployment wires their configs together; nothing below
imports it.
"""
