"""Tables and (later) plots of run summaries."""
