"""What every Tandem process shares: server bootstrap, the engine thread, conversions, errors."""
