"""What the tests share, in plain modules (never a test module): references, model families, batches, the rank
functions that longdoc.runtime.spawn pickles by module and name, and the model survey."""
