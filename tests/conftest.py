"""The suite's shared conftest: pytest puts this folder on sys.path, so every test folder can
import the kits kept here (`_cli_kit`: run the CLI in process, check its error contract)."""
