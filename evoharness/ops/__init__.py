"""Operations: git and DVC (lineage, records, reproduction), stage runs here and as jobs on a pool, the data gate,
MLflow tracking and the promotion gate. It drives ``agent``; ``agent`` never imports it."""
