"""Data for nestfed: real corpora readers (`.sources`), client partitions as index lists
(`.partition`) and tokenised training/evaluation sets (`.tasks`)."""
