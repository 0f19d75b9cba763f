"""What both services share about being served: the drain on SIGTERM and the limits at the edge."""
