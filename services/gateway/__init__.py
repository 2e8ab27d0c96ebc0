"""The gateway: the client-facing API, routing each request to a prefill and a decode worker."""
