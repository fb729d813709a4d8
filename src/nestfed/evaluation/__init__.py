"""Held-out evaluation: cross-entropy, perplexity and accuracy of a loaded model on a client's
test set (one pass or streamed at constant memory), and the streaming inference it rests on."""
