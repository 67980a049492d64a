"""The speculation core's tree step: proposal trees and their lossless verification."""
