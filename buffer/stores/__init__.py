"""The run's stores: interfaces (base.py), filesystem implementations (fs.py), network ones
(net.py, registered in buffer/run.py's transport table). Only these modules and buffer/run.py
compute run paths (buffer/layout.py's RunLayout)."""
