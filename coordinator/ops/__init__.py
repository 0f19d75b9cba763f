"""Operations: health and the heartbeat intake (`health`), Prometheus metrics (`metrics`), the status
page (`status_page`, `static/`) and the drain on SIGTERM (`drain`)."""
