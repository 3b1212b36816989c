"""Task generators shared by training data and evaluation (recall suites)."""
