"""What several benchmark suites and the integration tests share: Tandem server processes and meshes
of them, the load (requests, clients, the storm and the burst), the OpenAI SSE client, the metrics,
and where results are written."""
