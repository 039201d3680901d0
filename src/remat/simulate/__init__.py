"""Plan for hardware you don't have: fake-tensor simulation, device specs, analytic formulas."""
