"""The step: one batch in the AMP order (training and evaluation), its events, chunks, scaler and grad norm."""
