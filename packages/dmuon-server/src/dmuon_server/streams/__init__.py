"""What flows out of a running job: metrics ingestion, recipe events and the event streams."""
