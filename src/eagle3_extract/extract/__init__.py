"""eagle3-extract: the job (preflight, the loop, the manifest), the writer, data-parallel replicas."""
