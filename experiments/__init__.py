"""blockwork.experiments: configs, sweeps and reports."""
