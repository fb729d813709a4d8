"""Data for nestfed: real corpora readers (:mod:`.sources`), client partitions as index lists
(:mod:`.partition`) and tokenised training/evaluation sets (:mod:`.tasks`)."""
