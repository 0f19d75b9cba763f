"""The worker's HTTP side: the routes (`app`), the edge that admits a request into a job (`admission`),
and the SSE response that streams its channel (`event_stream`)."""
