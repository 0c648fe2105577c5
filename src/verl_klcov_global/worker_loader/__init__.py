"""Holds :mod:`verl_klcov_global_loader`, the module the driver ships to every Ray process (see ``driver.py``)."""
