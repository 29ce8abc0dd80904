"""The split check: a batch's weighted chunks checked against the full batch's gradient, once."""
