from pipeline.cli import main

if __name__ == "__main__":  # guarded: decoder processes re-import __main__
    main()
