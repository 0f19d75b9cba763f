"""The models a worker offers from a folder (issue 37): their headers read without their weights
(`gguf`), and what each would need and may be given (`catalog`)."""
