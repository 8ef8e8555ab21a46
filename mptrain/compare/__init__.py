"""Layer 11, compare: reads run directories (metrics, summaries, configs) and compares them in figures and tables; never trains."""
